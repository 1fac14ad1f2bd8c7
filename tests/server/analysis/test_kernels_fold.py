"""analysis.kernels without a database: categories of real kernel names, the bound on names kept per run,
and a fold that does not depend on the order or the chunking the windows arrive in."""

from __future__ import annotations

import random

import pytest
from fleetscope.server.analysis import kernels as K


@pytest.mark.parametrize("name, cat", [
    ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x64_32x6_nt_align1>(cutlass_80_tensorop_s1688gemm_128x64"
     "_32x6_nt_align1::Params)", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__"
     "5x_cublas", "gemm"),
    ("nvjet_tst_192x192_64x3_1x2_h_bz_coopA_NTN", "gemm"),
    ("ampere_sgemm_128x64_nn", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>"
     ", false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)",
     "attention"),
    ("void cutlass::Kernel<cutlass_tensorop_f16_s16816fprop_optimized_f16_64x64_64x4_nhwc_align8>(x)", "conv"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "comm"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "comm"),
    ("Memcpy HtoD (Pinned -> Device)", "memcpy"),
    ("Memset (Device)", "memcpy"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float)", "norm"),
    ("void cudnn::bn_bw_1C11_kernel_new<float, float, float2, 128, true, 1>(float, float)", "norm"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(float*)", "softmax"),
    ("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float, at::native::func_wrapper_t<float>>>(x)",
     "reduction"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float>>(int)",
     "elementwise"),
    ("triton_poi_fused_add_mul_0", "elementwise"),
    ("triton_red_fused_sum_1", "reduction"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>, float>(int)", "optimizer"),
    ("void split_embedding_codegen_forward_unweighted_kernel<c10::Half, c10::Half, float>(x)", "embedding"),
    ("void fbgemm_gpu::permute_2D_data_kernel<false, int, int>(int)", "elementwise"),  # fbgemm is not a GEMM
    ("some_custom_kernel", "other"),
])
def test_categories_of_real_kernel_names(name: str, cat: str) -> None:
    assert K.kernel_category(name) == cat
    assert cat in K.CATEGORIES


def _window(rank: int, seq: int, step: int, kernels: dict[str, float]) -> K.Window:
    return K.Window(rank=rank, seq=seq, step=step, steps=2,
                    kernels={n: (K.kernel_category(n), us, 1) for n, us in kernels.items()})


def test_names_beyond_the_bound_are_summed_into_their_category() -> None:
    st = K.KernelState()
    n = K.MAX_NAMES + 40
    windows = [_window(0, i, 100 + i, {f"ampere_sgemm_{i}": 10.0, "Memcpy HtoD": 1.0}) for i in range(n)]
    K.fold_windows(st, windows)
    real = st.names - {K.other_name(c) for c in K.CATEGORIES}
    assert len(real) == K.MAX_NAMES and "Memcpy HtoD" in real
    ks = st.kernels[0]
    assert len(ks) <= K.MAX_NAMES + len(K.CATEGORIES)
    over = ks[K.other_name("gemm")]
    assert over.category == "gemm" and over.time_us == pytest.approx(10.0 * (n - K.MAX_NAMES + 1))
    assert sum(a.time_us for a in ks.values()) == pytest.approx(11.0 * n)  # nothing lost
    assert st.ranks[0].kernel_us == pytest.approx(11.0 * n) and st.ranks[0].windows == n


def test_fold_is_independent_of_arrival_order_and_chunking() -> None:
    rng = random.Random(7)
    names = [f"k{i}" for i in range(12)]
    windows = [_window(r, step, step * 10, {n: rng.uniform(1, 100) for n in rng.sample(names, 6)})
               for r in range(4) for step in range(1, 9)]
    one = K.KernelState()
    K.fold_windows(one, windows)
    shuffled = windows[:]
    rng.shuffle(shuffled)
    chunked = K.KernelState()
    for i in range(0, len(shuffled), 5):
        K.fold_windows(chunked, shuffled[i:i + 5])
    assert chunked.ranks == one.ranks
    for r in range(4):
        for n, acc in one.kernels[r].items():
            got = chunked.kernels[r][n]
            assert (got.time_us, got.launches, got.windows, got.first_us, got.last_us) == pytest.approx(
                (acc.time_us, acc.launches, acc.windows, acc.first_us, acc.last_us))
    # first / last: the kernel's µs per step in the rank's earliest and latest window (0 when absent)
    for r in range(4):
        mine = [w for w in windows if w.rank == r]
        lo, hi = min(mine, key=lambda w: w.step), max(mine, key=lambda w: w.step)
        for n, acc in one.kernels[r].items():
            assert acc.first_us == pytest.approx(lo.kernels.get(n, ("", 0.0, 0))[1] / 2)
            assert acc.last_us == pytest.approx(hi.kernels.get(n, ("", 0.0, 0))[1] / 2)


def test_malformed_windows_are_skipped_entry_by_entry() -> None:
    data = {"active_steps": 3, "first_step": 40, "summary": {"top_kernels": [
        {"name": "ampere_sgemm_128x64_nn", "kernel_type": "COMPUTATION", "sum_us": 30.0, "count": 3},
        {"name": "bad", "sum_us": float("nan")}, {"name": "", "sum_us": 1.0}, "x", {"name": "neg", "sum_us": -1},
        {"name": "others", "kernel_type": "COMMUNICATION", "sum_us": 5.0, "count": 2},
    ]}}
    w = K.window_from_event(3, 9, 40, data)
    assert w is not None and (w.rank, w.seq, w.step, w.steps) == (3, 9, 40, 3)
    assert w.kernels == {"ampere_sgemm_128x64_nn": ("gemm", 30.0, 3), "(other comm kernels)": ("comm", 5.0, 2)}
    assert K.window_from_event(0, 1, 0, {"summary": {"top_kernels": []}}) is None  # a CPU-only trace
    assert K.window_from_event(0, 1, 0, ["not", "a", "dict"]) is None
