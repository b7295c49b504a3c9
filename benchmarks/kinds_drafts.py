"""The contenders of a search's kinds table as draft folders, and the `decode.bench` command that measures
them side by side on held-out prompts the search never saw.

    python benchmarks/kinds_drafts.py --search out/demo-fresh2 --out out/demo-fresh2-kinds
    # then run the printed decode.bench command

Writes under --out one folder per contender that is not the exported design itself: `lookup` (the table's
prompt-lookup row, a weightless checkpoint), `neural` (its best subnet alone) and `neural-lookup` (that
subnet merged with lookup as the table's row) exported from the search's supernet with nas.export, and
`eagle` (the EAGLE-like default subnet), and where the search fine-tuned its best subnet, `neural-tuned` and
`tuned-lookup` (the rows marked fine-tuned, with the weights of its OUT/finetune checkpoint). The bench
compares them with the exported design, the default prompt lookup, vanilla and transformers' generate /
prompt lookup.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
from pathlib import Path

from decode.drafts.corpus import CORPUS_NAME
from decode.drafts.kinds import save_training_free
from decode.drafts.prompt_lookup import LookupSpec
from decode.targets.loader import load_target
from nas.export import main as export_main

CONFIG = "draft_config.json"
CONTENDERS = {"prompt lookup": "lookup", "prompt + corpus lookup": "corpus-lookup", "best neural": "neural",
              "neural #1 + lookup": "neural-lookup", "EAGLE-like default": "eagle",
              "best neural, fine-tuned": "neural-tuned", "fine-tuned + lookup": "tuned-lookup"}  # label -> folder


def _row(rows: list[dict], label: str) -> dict | None:
    return next((r for r in rows if r.get("label") == label), None)


def _same_design(row: dict, chosen: dict) -> bool:
    """Whether a kinds-table row is the exported design (same kind, lookup settings and subnet)."""
    if row["kind"] != chosen.get("kind") or (row.get("lookup") or None) != (chosen.get("lookup") or None):
        return False
    if bool(row.get("tuned")) != ("finetune" in chosen.get("metadata", {})):
        return False
    return row["kind"] in ("prompt-lookup", "none") or json.loads(row["arch"]) == chosen.get("arch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--search", type=Path, required=True, help="a nas.search --out folder (summary.json, kinds.json)")
    ap.add_argument("--out", type=Path, required=True, help="folder for the contenders' draft folders")
    ap.add_argument("--prompts", default="sharegpt:10,images:3")
    args = ap.parse_args()
    summary = json.loads((args.search / "summary.json").read_text())
    rows = json.loads((args.search / "kinds.json").read_text())["rows"]
    setup, exported = summary["setup"], Path(summary["draft"])
    target = load_target(setup["target"])
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = json.loads((exported / CONFIG).read_text())
    methods = [str(exported)]
    for label, name in CONTENDERS.items():
        row = _row(rows, label)
        if row is None or _same_design(row, chosen):
            continue
        folder = args.out / name
        if row["kind"] == "prompt-lookup":
            save_training_free(folder, "prompt-lookup", target, LookupSpec(**row["lookup"]),
                               metadata={"source": str(args.search / "kinds.json"), "row": label})
        else:
            argv = ["--supernet", setup["supernet"], "--arch", row["arch"], "--out", str(folder)]
            if row.get("tuned"):  # the weights the search fine-tuned (its OUT/finetune)
                argv += ["--finetuned", str(args.search / "finetune")]
            if row.get("lookup"):
                lk = LookupSpec(**row["lookup"])
                fields = (lk.tree_depth, lk.max_ngram, lk.top_k, lk.weak_depth, lk.corpus_depth, lk.corpus_second,
                          lk.leaf_depth, lk.leaf_count)
                argv += ["--lookup", ":".join(map(str, fields)),
                         "--merge", row.get("merge", "union"), *(["--corpus", summary["corpus"]] if lk.uses_corpus
                                                                  else [])]
            export_main(argv)
        if row["kind"] == "prompt-lookup" and row["lookup"].get("corpus_depth"):  # carries the search's corpus
            shutil.copyfile(summary["corpus"], folder / CORPUS_NAME)
        methods.append(str(folder))
    methods.insert(1, "prompt-lookup")
    methods += ["hf-generate", "hf-lookup:2:2"]
    heldout = setup["heldout"].split(" (")[0]  # "DIR (all 120, ...)" -> DIR
    command = ["python", "-m", "decode.bench", "--target", setup["target"], "--drafts", ",".join(methods),
               "--prompts", args.prompts, "--exclude-data", heldout, "--max-new-tokens", "64", "--repeats", "2",
               "--out", f"benchmarks/results/bench-{setup['target']}-{args.search.name}.json"]
    print(shlex.join(command))


if __name__ == "__main__":
    main()
