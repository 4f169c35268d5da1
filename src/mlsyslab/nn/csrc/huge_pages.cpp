// Zeroed bytes on transparent huge pages, for the buffers a decode step streams or walks: the streamed weights
// (`nn.packed_linear.packed_for_inference`) and the KV pool (`serve.kv_cache`).
//
// A decode step reads every weight once, 269 MB for SmolLM2-135M in bf16: in 4 kB pages that is ~66,000
// pages a step, each a TLB miss and a page boundary the hardware prefetchers stop at. torch's CPU
// allocator asks for huge pages only when THP_MEM_ALLOC_ENABLE=1 was set before its first allocation,
// which a library cannot arrange. Here the buffer is 2 MB-aligned, a whole number of 2 MB pages, and
// madvise(MADV_HUGEPAGE)'d before it is touched, so the kernel backs it with huge pages where
// transparent huge pages are "always" or "madvise" (elsewhere, or if none are free, it gets 4 kB pages:
// same results, the old speed). Measured (Zen 3, bf16 batch 1, alternating in one process, 6 rounds):
// TPOT median 10.55 -> 10.26 ms; a sum over 512 MB read 26-28 GB/s in 4 kB pages, 29-31 in huge ones.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#ifdef __linux__
#include <sys/mman.h>
#endif

namespace mlsyslab {

// `bytes` zero bytes (uint8). Linux: an anonymous mapping (zero-filled by the kernel) trimmed to 2 MB
// boundaries, advised, then touched once per 4 kB so that every page is faulted in now rather than during
// serving (once per huge page where the kernel gives them). Elsewhere: zeroed aligned memory.
at::Tensor huge_page_zeros(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "bytes: >= 0, got ", bytes);
  constexpr int64_t kHugePage = 2 << 20;
  const int64_t rounded = std::max<int64_t>(kHugePage, (bytes + kHugePage - 1) / kHugePage * kHugePage);
#ifdef __linux__
  void* mapped = mmap(nullptr, rounded + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(mapped != MAP_FAILED, "huge_page_zeros: could not map ", rounded, " bytes");
  char* start = static_cast<char*>(mapped);
  char* data = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(start) + kHugePage - 1) / kHugePage * kHugePage);
  if (data > start) munmap(start, data - start);
  if (data + rounded < start + rounded + kHugePage) munmap(data + rounded, start + rounded + kHugePage - (data + rounded));
  madvise(data, rounded, MADV_HUGEPAGE);  // advice only: an error (no THP in this kernel) leaves 4 kB pages
  for (int64_t offset = 0; offset < rounded; offset += 4096) data[offset] = 0;
  return at::from_blob(data, {bytes}, [rounded](void* p) { munmap(p, rounded); }, at::TensorOptions().dtype(at::kByte));
#else
  void* data = std::aligned_alloc(kHugePage, rounded);
  TORCH_CHECK(data != nullptr, "huge_page_zeros: could not allocate ", rounded, " bytes");
  std::memset(data, 0, rounded);
  return at::from_blob(data, {bytes}, [](void* p) { std::free(p); }, at::TensorOptions().dtype(at::kByte));
#endif
}

}  // namespace mlsyslab

TORCH_LIBRARY_FRAGMENT(mlsyslab, m) {
  m.def("huge_page_zeros(int bytes) -> Tensor", &mlsyslab::huge_page_zeros);
}
