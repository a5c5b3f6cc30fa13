// The read-bandwidth probe of eval/bench.py: how fast the decode kernels' access pattern (a few sequential streams a
// thread, each prefetched ahead) reads a buffer far larger than the caches. A reduction such as torch.sum reads one
// stream a thread without software prefetch, which on some CPUs (the 2-core Xeon of docs/RESULTS.md) reads slower
// than the kernels themselves do, so a bound taken from it is not a bound.

#include "common.h"

#include <atomic>

namespace {
constexpr int64_t kLine = 64;        // bytes
constexpr int64_t kStreams = 4;      // sequential streams a thread reads at once
constexpr int64_t kAheadLines = 16;  // how far ahead each stream is prefetched (into L1: a non-temporal prefetch
                                     // halved the rate on that Xeon)
}  // namespace

// buffer: uint8 [n] -> the XOR of its 64-bit words over whole cache lines (returned, so that no read is optimised
// away). The lines are split over the threads; each thread's share is read as kStreams interleaved streams.
int64_t stream_xor(const at::Tensor& buffer) {
  check_cpu(buffer, at::kByte, "buffer");
  const int64_t lines = buffer.numel() / kLine;
  const uint8_t* bytes = buffer.data_ptr<uint8_t>();
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, lines, 4096, [&](int64_t begin, int64_t end) {
    const int64_t span = (end - begin) / kStreams;
    uint64_t mine = 0;
#if defined(CPU_CAPABILITY_AVX512)
    __m512i acc[kStreams];
    for (int64_t s = 0; s < kStreams; ++s) acc[s] = _mm512_setzero_si512();
    for (int64_t i = 0; i < span; ++i)
      for (int64_t s = 0; s < kStreams; ++s) {
        const uint8_t* line = bytes + (begin + s * span + i) * kLine;
        __builtin_prefetch(line + kAheadLines * kLine, 0, 3);
        acc[s] = _mm512_xor_si512(acc[s], _mm512_loadu_si512(line));
      }
    alignas(64) uint64_t lanes[8];
    for (int64_t s = 0; s < kStreams; ++s) {
      _mm512_store_si512(lanes, acc[s]);
      for (uint64_t lane : lanes) mine ^= lane;
    }
    const int64_t rest = begin + kStreams * span;
#else
    const int64_t rest = begin;  // without AVX-512: one stream, the compiler's vectorised loop
#endif
    const uint64_t* words = reinterpret_cast<const uint64_t*>(bytes);
    for (int64_t w = rest * 8; w < end * 8; ++w) mine ^= words[w];
    total.fetch_xor(mine);
  });
  return static_cast<int64_t>(total.load());
}
