// What the AMX kernels (small_gemm_amx.cpp, int8_gemm_amx.cpp) share: the OS permission to use
// the tile registers, and the LDTILECFG operand.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace pdserve_amx {

// Linux hands out AMX's 8 KB of tile state only to a process that asks for it (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, Linux 5.16+); a tile instruction without it is a SIGILL.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {   // the 64-byte operand of LDTILECFG, palette 1
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};   // bytes per row of tile i
  uint8_t rows[16] = {};
};

// LDTILECFG from cfg. The compiler barrier first: GCC 12 did not treat the builtin as reading all
// 64 bytes and dropped the stores of constant rows/colsb before it (the tiles then configured as
// none, and the first tile load faulted, SIGSEGV).
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

}  // namespace pdserve_amx
#endif
