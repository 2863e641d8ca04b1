// Launchers of the vvs_engine CUDA kernels: plain C entry points over raw device pointers and a
// stream, so the .cu files compile with nvcc alone (no torch headers). bindings.cpp wraps them for
// torch; .ci/compile_cuda.sh compiles the .cu files for sm_80 / sm_90a in CI.
//
// Conventions match vvs_engine/kernels/reference.py: indices and lengths are int64 device arrays;
// nothing is read back on the host.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Strides, in elements, of a [L, B, H, S, D] cache buffer (D is contiguous).
typedef struct {
  int64_t layer, batch, head, slot;
} VvsKvStrides;

// Tree metadata from parent indices (node 0 = root with parent -1, parents[i] < i, depth <= max_depth):
// ancestor_mask [n, n] (node i sees j iff j is i or an ancestor), depth [n], paths [n, max_depth + 1]
// (root -> i, -1 padded), is_leaf [n]. One thread block; n <= 4096.
cudaError_t vvs_tree_meta(const int64_t* parents, int64_t n, int64_t max_depth, bool* ancestor_mask,
                          int64_t* depth, int64_t* paths, bool* is_leaf, cudaStream_t stream);

// In place on K and V [L, B, H, S, D] (elem_size bytes per element, same shape for both): slot dst[j]
// takes what slot src[j] held before the call, in every layer, row and head. One launch for both
// buffers; each block stages its sources in shared memory before any store, so overlapping src/dst
// ranges are safe. n <= 2048. A pair with src or dst outside [0, n_slots) is skipped and sets
// *error_flag = 1 (error_flag may be null).
cudaError_t vvs_kv_compact(void* k, void* v, VvsKvStrides k_strides, VvsKvStrides v_strides,
                           int64_t n_layers, int64_t batch, int64_t heads, int64_t head_dim,
                           int64_t elem_size, const int64_t* src, const int64_t* dst, int64_t n,
                           int64_t n_slots, int* error_flag, cudaStream_t stream);

// Row copy between [B, *, D] tensors (D contiguous, strides in elements):
// out[b, out_row(j)] = in[b, in_row(j)] for j < n, where in_row(j) = in_index ? in_index[j] : j and
// out_row likewise. gather_rows passes in_index; scatter_rows_ passes out_index. A row with
// in_row outside [0, in_rows) or out_row outside [0, out_rows) is skipped and sets *error_flag = 1.
cudaError_t vvs_copy_rows(const void* in, int64_t in_stride_b, int64_t in_stride_s, const int64_t* in_index,
                          void* out, int64_t out_stride_b, int64_t out_stride_s, const int64_t* out_index,
                          int64_t batch, int64_t n, int64_t dim, int64_t elem_size, int64_t in_rows,
                          int64_t out_rows, int* error_flag, cudaStream_t stream);

// Acceptance walk over a verified tree: from root 0, move to the first child (first_child /
// next_sibling order) with accepted set, until none. path [max_depth + 1] (-1 padded),
// n_accepted [1] (non-root nodes on the path), last [1] (last node on the path). One tiny block.
cudaError_t vvs_accept_walk(const bool* accepted, const int64_t* first_child, const int64_t* next_sibling,
                            int64_t n, int64_t max_depth, int64_t* path, int64_t* n_accepted, int64_t* last,
                            cudaStream_t stream);

#ifdef __cplusplus
}
#endif
