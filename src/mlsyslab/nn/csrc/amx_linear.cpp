// The bf16 panel products (panel_linear.cpp) on AMX tiles, on CPUs that have them (Intel Sapphire Rapids and later).
//
// TDPBF16PS multiplies a tile of up to 16 rows × 32 bf16 (A) by a tile of 16 input pairs × 16 outputs (B) into 16 × 16
// fp32 sums (C): 16,384 multiply-adds an instruction, where VDPBF16PS does 32 (Intel SDM, TDPBF16PS; Intel
// Optimization Reference Manual, ch. 20). The panel layout is already AMX's B layout: a step of a panel is one input
// pair of its 48 outputs (192 bytes), so 16 consecutive steps read as three B tiles of 64-byte rows at a stride of 192
// bytes — the same tiles, the same sequential stream, no second copy. x's rows are the A tiles: blocks of 16 rows, the
// last one padded with zero rows (`panel_input`), or, in calls under 16 rows, one block of the call's rows. Per panel
// and block: three C tiles (48 outputs), and for each 16 steps one A tile and three B tiles loaded and three
// TDPBF16PS; the steps past the last whole 16 (inputs not a multiple of 32) are added by VDPBF16PS, as
// panel_linear.cpp does every step.
//
// Sums: TDPBF16PS adds each output's input pairs in input order, in fp32 (round to nearest even, denormals flushed,
// as VDPBF16PS), so outputs agree with the vector kernel's to the last bit but for a few in 10^4 (its order within a
// pair is the hardware's). Each output depends only on its row of x and column of W, by the same instructions at any
// row count: a row's result does not depend on the batch (tests/nn/test_cpu_kernels.py).
//
// Why: VDPBF16PS issued at half a 512-bit FMA's rate here (2-core Sapphire Rapids VM, 2026-12-01: 0.84 against 1.51
// G instructions/s a core), so the vector kernel ran SmolLM2's 121 bf16 matrices at 80-140 GFLOP/s from 8 rows on,
// behind oneDNN's AMX matmul from 12 rows. On tiles, alternating in one process (medians, ms a pass over the 121
// matrices; the sum read 16-18 GB/s): 1 / 16 / 32 / 64 / 256 rows 19.3-20.3 / 20.2-20.8 / 27.2-28.7 / 44.4-47.7 / 146
// against oneDNN's packed 28.4-31.5 / 31.4-34.8 / 42.6-52.3 / 37.6-38.8 / 128 and the vector kernel's 20.4 / 43.7 /
// 76.8 at 1 / 16 / 32 (`nn.packed_linear.streamed_below`: tiles under 48 rows). Each 16 rows past the first re-read
// the panel from L2 at ~190 ns a 16-step chunk, ~4x a loop over one panel alone; the two vCPUs of that VM share one
// core's units (two copies of a TDPBF16PS loop ran 2.5x slower side by side), so wide products gain little from the
// second thread.
//
// Linux hands out the tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA;
// Documentation/arch/x86/xstate.rst): `amx_ready` asks once; where it is refused, or MLSYS_AMX=0, the vector kernel
// runs. oneDNN configures the same tiles its own way on the same threads, so each call loads its configuration and
// releases the tiles when done.
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

using namespace mlsyslab;
using Bf16 = c10::BFloat16;

constexpr int64_t kStepBytes = kPanel * 4;           // one input pair of a panel's 48 outputs
constexpr int64_t kTileBytes = 64;                   // a tile row: 32 bf16, or 16 fp32
constexpr int64_t kStepsPerTile = kAmxRows;          // input pairs of an A row / rows of a B tile
// How far ahead of its tile loads a block streaming a panel from memory asks for it (prefetcht0). Tile loads alone
// kept 0.56 of a sum's bandwidth at 1 row; 2 KB ahead 0.78-0.79 (= the vector kernel's), 1 KB 0.76, 4 KB 0.79,
// T1 / T2 hints the same, NTA 0.57 (SmolLM2's 121 matrices, variants alternating in one process, 2026-12-01; with
// tiles of the call's rows, below, 3-6 KB ahead were 0.99-1.03x 2 KB's, 1 KB 0.94x, 2026-12-02).
constexpr int64_t kAhead = 2048;

// Palette 1: tile 0 the A tile, 1-3 the B tiles, 4-6 the C tiles, rows of 64 bytes (Intel SDM, LDTILECFG). The B
// tiles have 16 rows (input pairs); the A and C tiles as many rows as a block of x has — all 16 for calls over 16
// rows (the last block padded with zero rows), the call's own rows under 16. TDPBF16PS's work is the A tile's rows:
// at 1 row on 16-row tiles a block computed 15 zero rows, and with 1-row tiles a pass over SmolLM2's 121 matrices at
// 1 row streamed 1.08x faster (paired medians over 40 passes; 1.04-1.05x at 2-8 rows, 1.00x at 12) and the batch-1
// bf16 decode step 1.06x (TPOT 21.6 against 22.7 ms, greedy tokens the same; 2026-12-02). Each row's sums are the
// same either way (a row of C depends only on its row of A).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int64_t block_rows) {
    for (int tile = 0; tile < 7; ++tile) {
      bytes_per_row[tile] = kTileBytes;
      rows[tile] = tile >= 1 && tile <= 3 ? kStepsPerTile : block_rows;
    }
  }
};

// The configuration for calls over `rows` (>= 1) rows of x.
const TileConfig& tile_config(int64_t rows) {
  static const auto configs = [] {
    std::vector<TileConfig> by_rows;
    for (int64_t block_rows = 1; block_rows <= kAmxRows; ++block_rows) by_rows.emplace_back(block_rows);
    return by_rows;
  }();
  return configs[std::min(kAmxRows, rows) - 1];
}

bool tiles_granted() {
  if (const char* flag = std::getenv("MLSYS_AMX"); flag != nullptr && std::strcmp(flag, "0") == 0) return false;
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

// sums[r][c] += x row r's steps [from, steps) · the panel's, by VDPBF16PS in step order (rows < kAmxRows).
void add_last_steps(const Bf16* x, int64_t steps, int64_t from, const char* panel, int64_t rows, float* sums) {
  for (int64_t r = 0; r < rows; ++r) {
    __m512 acc[3];
    for (int v = 0; v < 3; ++v) acc[v] = _mm512_loadu_ps(sums + r * kPanel + 16 * v);
    for (int64_t step = from; step < steps; ++step) {
      int32_t pair;
      std::memcpy(&pair, x + (r * steps + step) * 2, sizeof pair);
      const __m512bh xs = __m512bh(_mm512_set1_epi32(pair));
      for (int v = 0; v < 3; ++v)
        acc[v] = _mm512_dpbf16_ps(acc[v], xs, __m512bh(_mm512_loadu_si512(panel + step * kStepBytes + 64 * v)));
    }
    for (int v = 0; v < 3; ++v) _mm512_storeu_ps(sums + r * kPanel + 16 * v, acc[v]);
  }
}

// y[0, columns) = sums + residual, rounded once (vec.h `narrow`): the residual's test out of the loop, so that the
// compiler vectorizes it (with the test inside, the scalar loop over a block's 16 × 48 outputs cost as much as its
// products).
void store_row(const float* sums, const Bf16* residual, Bf16* y, int64_t columns) {
  if (residual != nullptr) {
    for (int64_t c = 0; c < columns; ++c) y[c] = narrow<Bf16>(sums[c] + widen(residual[c]));
  } else {
    for (int64_t c = 0; c < columns; ++c) y[c] = narrow<Bf16>(sums[c]);
  }
}

}  // namespace

namespace mlsyslab {

bool amx_ready() {
  static const bool ready = tiles_granted();
  return ready;
}

void amx_panel_products(const StreamedProduct<Bf16>& p, int64_t begin, int64_t end) {
  if (p.rows == 0 || begin >= end) return;  // nothing to compute (and tiles of 0 rows are no valid configuration)
  const Bf16* x = static_cast<const Bf16*>(p.x);
  const int64_t steps = p.chunks, whole = steps / kStepsPerTile * kStepsPerTile, row_bytes = steps * 4;
  alignas(64) float sums[kAmxRows * kPanel];
  _tile_loadconfig(&tile_config(p.rows));
  for (int64_t panel = begin; panel < end; ++panel) {
    const char* weights = reinterpret_cast<const char*>(p.tiles + panel * steps * kPanel * 2);
    const int64_t first = panel * kPanel, columns = std::min(kPanel, p.out - first);
    for (int64_t row = 0; row < p.rows; row += kAmxRows) {
      const char* block = reinterpret_cast<const char*>(x + row * steps * 2);
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      for (int64_t step = 0; step < whole; step += kStepsPerTile) {
        const char* b = weights + step * kStepBytes;
        if (row == 0)  // the first block streams the panel from memory; later ones find it in L2
          for (int64_t line = 0; line < kStepsPerTile * kStepBytes; line += 64) _mm_prefetch(b + kAhead + line, _MM_HINT_T0);
        _tile_loadd(0, block + step * 4, row_bytes);
        _tile_loadd(1, b, kStepBytes);
        _tile_loadd(2, b + 64, kStepBytes);
        _tile_loadd(3, b + 128, kStepBytes);
        _tile_dpbf16ps(4, 0, 1);
        _tile_dpbf16ps(5, 0, 2);
        _tile_dpbf16ps(6, 0, 3);
      }
      _tile_stored(4, sums, kStepBytes);
      _tile_stored(5, sums + 16, kStepBytes);
      _tile_stored(6, sums + 32, kStepBytes);
      const int64_t rows = std::min(kAmxRows, p.rows - row);
      if (whole < steps) add_last_steps(x + row * steps * 2, steps, whole, weights, rows, sums);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (row + r) * p.out + first;
        store_row(sums + r * kPanel, p.residual ? p.residual + at : nullptr, p.y + at, columns);
      }
    }
  }
  _tile_release();
}

}  // namespace mlsyslab

#else

namespace mlsyslab {

bool amx_ready() { return false; }
void amx_panel_products(const StreamedProduct<c10::BFloat16>&, int64_t, int64_t) {}

}  // namespace mlsyslab

#endif
