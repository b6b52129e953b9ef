"""One-off measurements behind findings recorded in docs/CUDA_NOTES.md and docs/RESULTS.md, kept
to re-run them: ``python -m ds_mtraining.bench.probes.<name>`` on a GPU, as the benchmarks start.

* :mod:`.dq_reduction_probe`: the float32 dQ reductions a one-kernel backward would add;
* :mod:`.ncu_flex_case`: one FlexAttention fwd+bwd for Nsight Compute;
* :mod:`.power_probe`: GPU power and clocks while the kernels run;
* :mod:`.query_kernel_probe`: the query-side kernels compared bit for bit and by time.
"""
