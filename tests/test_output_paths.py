"""Outputs are checked before long work, huge images and image folders get one clear line."""

from __future__ import annotations

import pytest
from PIL import Image

from decode.errors import UserError
from decode.images import load_image
from decode.paths import writable_dir, writable_file


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "taken"
    f.write_text("x")
    return f


def test_writable_dir_and_file(tmp_path, a_file):
    assert writable_dir(tmp_path / "new" / "deep").is_dir()  # created, as the run would
    assert not list((tmp_path / "new" / "deep").iterdir())  # the probe file is gone
    with pytest.raises(UserError, match="is an existing file, not a folder"):
        writable_dir(a_file)
    with pytest.raises(UserError, match="not writable"):
        writable_dir(a_file / "sub")
    assert writable_file(tmp_path / "a" / "b.json").parent.is_dir()
    with pytest.raises(UserError, match="is a folder"):
        writable_file(tmp_path)
    with pytest.raises(UserError, match="which is a file"):
        writable_file(a_file / "sub" / "x.json", "--profile-out")


def _fails_fast(main, argv, match):
    """The output check comes first: no target, data or profile is needed to get the error."""
    with pytest.raises(UserError, match=match):
        main(argv)


def test_clis_refuse_an_unwritable_out_before_work(tmp_path, a_file):
    from decode.bench import main as bench_main
    from hwprofile.profile import main as profile_main
    from nas.search import main as search_main
    from supernet.data import main as data_main
    from supernet.train import main as train_main

    _fails_fast(data_main, ["--target", "tiny-llava", "--out", str(a_file)], "--out .* existing file")
    _fails_fast(train_main, ["--target", "tiny-llava", "--data", str(tmp_path), "--out", str(a_file)],
                "--out .* existing file")
    _fails_fast(profile_main, ["--target", "tiny-llava", "--out", str(a_file / "p.json")], "which is a file")
    _fails_fast(bench_main, ["--target", "tiny-llava", "--drafts", "prompt-lookup", "--out", str(tmp_path)], "is a folder")
    _fails_fast(search_main, ["--target", "tiny-llava", "--scale", "smoke", "--out", str(a_file)], "existing file")
    _fails_fast(search_main, ["--target", "tiny-llava", "--scale", "smoke", "--out", str(tmp_path / "o"),
                              "--cache-dir", str(a_file)], "--cache-dir .* existing file")


def test_image_folder_and_decompression_bomb(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="is a folder"):
        load_image(str(tmp_path))
    big = tmp_path / "big.png"
    Image.new("L", (300, 300)).save(big)
    # Pillow refuses images over 2 x MAX_IMAGE_PIXELS (a 15000 x 15000 PNG by default); lower it instead of
    # writing 225 MP in a test
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)
    with pytest.raises(UserError, match="too large to decode safely.*downscale"):
        load_image(str(big))
