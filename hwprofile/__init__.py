"""hwprofile: latency of drafts and targets on a device, measured with the real decode code or predicted.

    python -m hwprofile.profile --hardware cpu --target smolvlm-135m     # measure here -> profiles/cpu-smolvlm-135m.json
    python -m hwprofile.profile --hardware h200 --predict                # roofline from configs/hardware/h200.yaml
    python -m hwprofile.validate --profile profiles/cpu-smolvlm-135m.json --samples 20

    from hwprofile.latency import LatencyModel
    m = LatencyModel.load("profiles/cpu-smolvlm-135m.json")
    m.cycle_ms(arch, accepted=tau, context=512)   # draft cycle + verify(total_tokens + 1) + overhead
    m.speedup(arch, tau)                          # tau * T_step / T_cycle

Modules (one concept each): device (identity, canonical names), specs (spec sheets), timing
(CUDA events / perf_counter, round-robin repeats, trimmed median + IQR), census (FLOPs / traffic /
kernels of a real call), tables (structured keys, interpolation), schema (the profile file),
config (ProfileConfig, grids), cycle (the loop body as the profiler splits it), bench_target,
bench_draft, bench_overhead (the measurements), measure (a measured profile), latency (the
predictor), roofline + predict (profiles of devices not present), validation + validate (predicted
vs real cycles), plot, profile (the CLI).
"""
