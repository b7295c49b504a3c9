"""Images for prompts: load a user's file, or one of the photos bundled with scikit-image."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, UnidentifiedImageError

from decode.errors import UserError

# photos shipped inside scikit-image (no download): name -> function in skimage.data
_LOADERS = {"astronaut": "astronaut", "coffee": "coffee", "chelsea": "chelsea", "rocket": "rocket", "cat": "cat",
            "immunohistochemistry": "immunohistochemistry", "motorcycle_left": "stereo_motorcycle"}
BUNDLED_PHOTOS = tuple(_LOADERS)


def load_image(image: object) -> Image.Image:
    """A PIL image in RGB from a PIL image, a path, or `skimage:NAME` for a bundled photo."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    text = str(image)
    if text.startswith("skimage:"):
        return bundled_photo(text.split(":", 1)[1])
    path = Path(text)
    if path.is_dir():
        raise UserError(f"image '{text}' is a folder; give the path of a PNG/JPEG file or skimage:NAME")
    if not path.is_file():
        raise UserError(f"image '{text}' does not exist; give the path of a PNG/JPEG file or skimage:NAME ({', '.join(BUNDLED_PHOTOS)})")
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except Image.DecompressionBombError:  # Pillow refuses more than 2 x MAX_IMAGE_PIXELS before decoding
        raise UserError(f"image '{text}' is too large to decode safely (over {2 * Image.MAX_IMAGE_PIXELS:,} pixels); "
                        "downscale it first (the vision encoder resizes it to a few hundred pixels anyway)") from None
    except (UnidentifiedImageError, OSError) as err:
        raise UserError(f"cannot read image '{text}' ({err.__class__.__name__}); give a PNG/JPEG file") from None


def bundled_photo(name: str) -> Image.Image:
    """One of scikit-image's bundled photos as RGB."""
    import skimage.data

    if name not in BUNDLED_PHOTOS:
        raise UserError(f"unknown bundled photo '{name}'; choose one of: {', '.join(BUNDLED_PHOTOS)}")
    arr = getattr(skimage.data, _LOADERS[name])()
    if isinstance(arr, tuple):  # stereo pairs come as (left, right, disparity)
        arr = arr[0]
    return Image.fromarray(arr).convert("RGB")
