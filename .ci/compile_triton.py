"""Compile the Triton kernels for sm_90 without a GPU (ttir -> ttgir -> llir -> ptx -> cubin with
Triton's bundled ptxas), at representative constexpr settings: catches code the interpreter accepts
but the compiler rejects (e.g. reassigned constexprs). Slow (minutes on 2 loaded cores).

    env -u TRITON_INTERPRET python .ci/compile_triton.py   # prints OK/FAIL per kernel; exit 1 on a FAIL
"""
import sys
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import importlib
ta = importlib.import_module("triton_kernels.tree_attention")
dt = importlib.import_module("triton_kernels.draft_topk")
ra = importlib.import_module("triton_kernels.relaxed_acceptance")
ts = importlib.import_module("triton_kernels.tree_select")
target = GPUTarget("cuda", 90, 32)
FAILED = []

def build(fn, sig, consts, name):
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        k = triton.compile(src, target=target, options={"num_warps": 4})
        print("OK", name, "cubin" in k.asm, len(k.asm.get("ptx", "")))
    except Exception as e:
        c = e
        while c.__cause__ is not None: c = c.__cause__
        print("FAIL", name, type(c).__name__, str(c)[-1200:])
        FAILED.append(name)

def sigs(fn, types, consts):
    names = fn.arg_names
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        else:
            sig[n] = types.get(n, "i32")
    return sig

# tree attention
P = "*bf16"
for BQ, split in [(1, True), (64, True), (128, False)]:
    consts = dict(HEAD_DIM=64, HAS_KEY_VALID=False, DOT_PRECISION="tf32", DOT_UPCAST=False, SPLIT=split,
                  BLOCK_Q=BQ, BLOCK_N=64, BLOCK_D=64)
    types = dict(q_ptr=P, k_ptr=P, v_ptr=P, out_ptr=P, part_acc_ptr="*fp32", part_ml_ptr="*fp32", prefix_len_ptr="*i64",
                 local_ptr="*u8", key_valid_ptr="*u8", qk_scale_log2="fp32")
    fn = ta._tree_attention_kernel
    build(fn, sigs(fn, types, consts), consts, f"tree_attention BQ{BQ} split{split}")
fn = ta._merge_splits_kernel
consts = dict(HEAD_DIM=64, BLOCK_S=8, BLOCK_D=64)
build(fn, sigs(fn, dict(part_acc_ptr="*fp32", part_ml_ptr="*fp32", out_ptr=P), consts), consts, "merge_splits")
# draft topk
fn = dt._chunk_sort_kernel
consts = dict(USE_CFG=True, CHUNK=4096, LOG_CHUNK=12)
build(fn, sigs(fn, dict(logits_ptr="*fp32", keys_ptr="*i32", cum_ptr="*fp32", cmax_ptr="*fp32", cfg_scale="fp32", temperature="fp32"), consts), consts, "chunk_sort")
fn = dt._thresholds_kernel
consts = dict(USE_TOP_K=True, USE_TOP_P=True, CHUNK=4096, LOG_CHUNK=12, BLOCK_C=64, RADIX_BITS=4)
build(fn, sigs(fn, dict(keys_ptr="*i32", cum_ptr="*fp32", cmax_ptr="*fp32", thr_ptr="*i64", mz_ptr="*fp32", top_p="fp32"), consts), consts, "thresholds")
fn = dt._chunk_candidates_kernel
consts = dict(K=10, USE_CFG=True, NOISE=2, CHUNK=4096)
build(fn, sigs(fn, dict(logits_ptr="*fp32", noise_ptr="*fp32", seed_offset_ptr="*i64", thr_ptr="*i64", mz_ptr="*fp32",
                        cand_score_ptr="*fp32", cand_tok_ptr="*i32", cand_p_ptr="*fp32", cfg_scale="fp32", temperature="fp32"), consts), consts, "candidates")
fn = dt._merge_candidates_kernel
consts = dict(K=10, BLOCK=512)
build(fn, sigs(fn, dict(cand_score_ptr="*fp32", cand_tok_ptr="*i32", cand_p_ptr="*fp32", tokens_ptr="*i64", logp_ptr="*fp32"), consts), consts, "merge_candidates")
fn = ra._lantern_mass_kernel
consts = dict(RATIO=False, BLOCK_K=8)
build(fn, sigs(fn, dict(p_ptr="*fp32", tokens_ptr="*i64", neighbors_ptr="*i64", relaxed_ptr="*fp32", m_star_ptr="*i64", error_ptr="*i32", delta="fp32"), consts), consts, "lantern_mass")
fn = ra._group_mass_kernel
consts = dict(BLOCK_G=8)
build(fn, sigs(fn, dict(p_ptr="*fp32", q_ptr="*fp32", members_ptr="*i64", sum_p_ptr="*fp32", sum_q_ptr="*fp32", error_ptr="*i32"), consts), consts, "group_mass")
# dynamic-tree selection: fp32 (the engine) and fp64 (the fill constants of nan_to_num in fp64)
fn = ts._tree_select_kernel
for fdt, pos in (("fp32", 3.4028234663852886e38), ("fp64", 1.7976931348623157e308)):
    consts = dict(MAX_DEPTH=5, MAX_CHILDREN=10, POS_FILL=pos, NEG_FILL=-1e30, BLOCK_I=64, BLOCK_J=64, BLOCK_R=64,
                  BLOCK_K=64, BLOCK_P=8, BLOCK_CH=16)
    types = dict(score_ptr="*" + fdt, penalty_ptr="*" + fdt, frontier_ptr="*i64", foff_ptr="*i64", pcol_ptr="*i64",
                 ctok_ptr="*i64", clp_ptr="*" + fdt, tok_ptr="*i64", par_ptr="*i64", mask_ptr="*u8", depth_ptr="*i64",
                 paths_ptr="*i64", leaf_ptr="*u8", child_ptr="*i64", lp_ptr="*" + fdt, before_ptr="*i32", taken_ptr="*i8")
    build(fn, sigs(fn, types, consts), consts, f"tree_select {fdt}")
# batch-invariant mode: the one-tiling matmul (bf16, fp32) and the fixed-split attention with its in-order merge
im = importlib.import_module("triton_kernels.invariant_matmul")
ia = importlib.import_module("triton_kernels.invariant_attention")
fn = im._invariant_matmul_kernel
for fdt, prec in (("bf16", "tf32"), ("fp32", "ieee")):
    consts = dict(HAS_BIAS=True, DOT_PRECISION=prec, UPCAST=False, BLOCK_M=im.BLOCK_M, BLOCK_N=im.BLOCK_N, BLOCK_K=im.BLOCK_K)
    types = dict(x_ptr="*" + fdt, w_ptr="*" + fdt, bias_ptr="*" + fdt, y_ptr="*" + fdt)
    build(fn, sigs(fn, types, consts), consts, f"invariant_matmul {fdt}")
for BQ in (1, 64):
    consts = dict(HEAD_DIM=64, HAS_KEY_VALID=True, DOT_PRECISION="tf32", DOT_UPCAST=False, SPLIT_KEYS=ia.SPLIT_KEYS,
                  BLOCK_Q=BQ, BLOCK_N=64, BLOCK_D=64)
    types = dict(q_ptr=P, k_ptr=P, v_ptr=P, part_acc_ptr="*fp32", part_ml_ptr="*fp32", prefix_len_ptr="*i64",
                 local_ptr="*u8", key_valid_ptr="*u8", qk_scale_log2="fp32")
    fn = ia._invariant_attention_kernel
    build(fn, sigs(fn, types, consts), consts, f"invariant_attention BQ{BQ}")
fn = ia._merge_in_order_kernel
consts = dict(HEAD_DIM=64, BLOCK_D=64)
build(fn, sigs(fn, dict(part_acc_ptr="*fp32", part_ml_ptr="*fp32", out_ptr=P), consts), consts, "invariant merge_in_order")
sys.exit(1 if FAILED else 0)
