"""nas: hardware-aware search of the speculative-decoding draft, and its export as a standalone draft.

    python -m nas.search [--hardware h200] [--supernet CKPT] [--trials 100]   # -> OUT/draft + report
    python -m nas.export --supernet CKPT --trial N --storage URL --out DIR    # any trial / arch as a draft

Modules (one concept each): acceptance (tau by greedy replay on stored target data), cost (draft
parameters, extra memory), suggest (the SearchSpace as Optuna parameters; starting archs),
objective (predicted speed-up, budgets as constraints, tau cache), study (storage, sampler,
resume checks), loading (supernet checkpoint, held-out sequences), hardware (device name ->
stored / measured / predicted profile), pipeline (held-out data -> profile -> data -> supernet,
cached), report (CSV, table, plot), finetune (short training of the chosen subnet), export, search.
"""

import time

# when this package was imported: `python -m nas.search` counts a scale's deadline from here, since its imports (torch,
# transformers: ~10 s on 2 cores) come before main() runs
IMPORTED = time.perf_counter()
