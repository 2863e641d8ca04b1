// Tree metadata from parent indices, one thread block (the SGLang build_tree pattern: one thread per
// node walks to the root). Trees are small (59-64 nodes for EAGLE-2 on LlamaGen), so a single block
// with the parent array in shared memory is both the simplest and the fastest layout.
#include "vvs_kernels.h"

namespace {

__global__ void tree_meta_kernel(const int64_t* __restrict__ parents, int64_t n, int64_t max_depth,
                                 bool* __restrict__ ancestor_mask, int64_t* __restrict__ depth,
                                 int64_t* __restrict__ paths, bool* __restrict__ is_leaf) {
  extern __shared__ int64_t parent_of[];
  const int64_t path_width = max_depth + 1;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    parent_of[i] = parents[i];
    is_leaf[i] = true;
  }
  __syncthreads();
  // Every node with a parent marks that parent as inner; equal writes, so the races are benign.
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t p = parent_of[i];
    if (p >= 0) is_leaf[p] = false;
  }
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    bool* row = ancestor_mask + i * n;
    for (int64_t j = 0; j < n; ++j) row[j] = false;
    // Walk i -> root once for the mask and the depth (bounded by n against malformed input).
    int64_t d = 0;
    int64_t node = i;
    row[node] = true;
    while (parent_of[node] >= 0 && d < n) {
      node = parent_of[node];
      row[node] = true;
      ++d;
    }
    depth[i] = d;
    // Walk again to write the path root -> i from its far end.
    int64_t* path = paths + i * path_width;
    for (int64_t j = 0; j < path_width; ++j) path[j] = -1;
    node = i;
    for (int64_t pos = d; pos >= 0 && node >= 0; --pos) {
      if (pos < path_width) path[pos] = node;
      node = parent_of[node];
    }
  }
}

}  // namespace

extern "C" cudaError_t vvs_tree_meta(const int64_t* parents, int64_t n, int64_t max_depth, bool* ancestor_mask,
                                     int64_t* depth, int64_t* paths, bool* is_leaf, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (n > 4096) return cudaErrorInvalidValue;  // shared-memory parent array
  const int threads = n >= 256 ? 256 : static_cast<int>((n + 31) / 32 * 32);
  tree_meta_kernel<<<1, threads, n * sizeof(int64_t), stream>>>(parents, n, max_depth, ancestor_mask, depth,
                                                                 paths, is_leaf);
  return cudaGetLastError();
}
