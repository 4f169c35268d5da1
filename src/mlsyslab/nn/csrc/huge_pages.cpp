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
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#ifdef __linux__
#include <sys/mman.h>
#endif

namespace mlsyslab {

#ifdef __linux__
namespace {

constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE (Linux 5.14), spelled out for older headers

// Faults a mapping in from a thread of its own, 64 MB at a time, until done or stopped. MADV_POPULATE_WRITE maps
// each page as a write would without writing it, so the pool can be used meanwhile: a page the engine writes first
// is faulted by that write, and populate skips it. On a kernel without it, the pages fault on first use instead.
struct BackgroundPopulate {
  std::atomic<bool> stop{false};
  std::thread thread;

  BackgroundPopulate(char* data, int64_t bytes) {
    thread = std::thread([this, data, bytes] {
      constexpr int64_t kStep = int64_t(64) << 20;
      for (int64_t offset = 0; offset < bytes && !stop.load(std::memory_order_relaxed); offset += kStep)
        if (madvise(data + offset, std::min(kStep, bytes - offset), kPopulateWrite) != 0) return;
    });
  }
  ~BackgroundPopulate() {
    stop = true;
    thread.join();  // before the mapping goes
  }
};

}  // namespace
#endif

// `bytes` zero bytes (uint8). Linux: an anonymous mapping (zero-filled by the kernel) trimmed to 2 MB
// boundaries, advised, then touched once per 4 kB so that every page is faulted in now rather than during
// serving (once per huge page where the kernel gives them); with `in_background`, faulted in by a thread of its
// own while the caller goes on (the KV pool: on a VM a fresh huge page can cost ~7 ms to fault, 3.5-4 s for the
// default 1 GB pool, measured on the Zen 3 host, which was most of `mlsys serve`'s start-up). Elsewhere: zeroed
// aligned memory.
at::Tensor huge_page_zeros(int64_t bytes, bool in_background) {
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
  if (in_background) {
    auto populate = std::make_shared<BackgroundPopulate>(data, rounded);
    return at::from_blob(data, {bytes}, [rounded, populate](void* p) mutable { populate.reset(); munmap(p, rounded); },
                         at::TensorOptions().dtype(at::kByte));
  }
  for (int64_t offset = 0; offset < rounded; offset += 4096) data[offset] = 0;
  return at::from_blob(data, {bytes}, [rounded](void* p) { munmap(p, rounded); }, at::TensorOptions().dtype(at::kByte));
#else
  (void)in_background;
  void* data = std::aligned_alloc(kHugePage, rounded);
  TORCH_CHECK(data != nullptr, "huge_page_zeros: could not allocate ", rounded, " bytes");
  std::memset(data, 0, rounded);
  return at::from_blob(data, {bytes}, [](void* p) { std::free(p); }, at::TensorOptions().dtype(at::kByte));
#endif
}

}  // namespace mlsyslab

TORCH_LIBRARY_FRAGMENT(mlsyslab, m) {
  m.def("huge_page_zeros(int bytes, bool in_background=False) -> Tensor", &mlsyslab::huge_page_zeros);
}
