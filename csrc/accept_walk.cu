// The tree acceptance walk (SGLang's VerifyTreeGreedy / vLLM's greedy rejection walk): a handful of
// dependent scalar steps, so one thread does the walk and the kernel exists only to keep the step on
// the device (no host sync, CUDA-graph capturable). The rule that set `accepted` (exact match, LANTERN
// relaxed mass, VVS skip) is decided beforehand; this kernel only follows the first-child /
// next-sibling order.
#include "vvs_kernels.h"

namespace {

__global__ void accept_walk_kernel(const bool* __restrict__ accepted, const int64_t* __restrict__ first_child,
                                   const int64_t* __restrict__ next_sibling, int64_t n, int64_t max_depth,
                                   int64_t* __restrict__ path, int64_t* __restrict__ n_accepted,
                                   int64_t* __restrict__ last) {
  // Padding first, in parallel; the walk then overwrites the prefix it reaches.
  for (int64_t d = threadIdx.x; d <= max_depth; d += blockDim.x) path[d] = -1;
  __syncthreads();
  if (threadIdx.x != 0) return;
  int64_t node = 0;
  int64_t depth = 0;
  path[0] = 0;
  while (depth < max_depth) {
    int64_t child = first_child[node];
    int64_t scanned = 0;  // bound the sibling scan against malformed lists
    while (child >= 0 && !accepted[child] && scanned < n) {
      child = next_sibling[child];
      ++scanned;
    }
    if (child < 0 || scanned >= n) break;
    node = child;
    path[++depth] = node;
  }
  *n_accepted = depth;
  *last = node;
}

}  // namespace

extern "C" cudaError_t vvs_accept_walk(const bool* accepted, const int64_t* first_child, const int64_t* next_sibling,
                                       int64_t n, int64_t max_depth, int64_t* path, int64_t* n_accepted,
                                       int64_t* last, cudaStream_t stream) {
  accept_walk_kernel<<<1, 32, 0, stream>>>(accepted, first_child, next_sibling, n, max_depth, path, n_accepted,
                                           last);
  return cudaGetLastError();
}
