// One launch of one of aieng's kernels on the host (emulate.h), driven by tests:
//
//   run_kernel KERNEL GX GY GZ BX BY ARG...
//
// each ARG is `p:OFFSET:FILE` (a buffer read from FILE and written back after the launch; the
// pointer OFFSET bytes into it), `o:INDEX:OFFSET` (a pointer OFFSET bytes into the buffer of
// argument INDEX), `n` (a null pointer), `i:INT`, `l:INT64` or `f:FLOAT`, in the kernel's
// parameter order. Buffers are exactly their file's size, 256-byte aligned as cudaMalloc's: in
// the AddressSanitizer build a read past a buffer's end is an error, as compute-sanitizer's
// memcheck reports it on the GPU. AIENG_HOST_COPIES=early makes every cp.async land at once
// (emulate.h); the default lands them at their wait.
#include "emulate.h"

#include "fused_ops.cu"
#include "int4_gemm.cu"
#include "int4_gemv.cu"
#include "paged_attention_decode.cu"
#include "paged_attention_prefill.cu"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <new>
#include <string>

struct Buffer {  // exactly `size` bytes, 256-byte aligned
  explicit Buffer(size_t size) : size(size) {
    void* memory = nullptr;
    if (posix_memalign(&memory, 256, size ? size : 1)) throw std::bad_alloc();
    data.reset(static_cast<char*>(memory));
  }
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  size_t size;
  std::unique_ptr<char, Free> data;
};

struct Arg {
  std::string file;
  std::unique_ptr<Buffer> buffer;
  void* p = nullptr;
  long long i = 0;
  float f = 0.f;
};

using P = void*;
using Call = std::function<void(std::vector<Arg>&)>;

template <typename... T>
Call caller(void (*kernel)(T...)) {
  return [kernel](std::vector<Arg>& a) {
    size_t k = 0;
    auto next = [&](auto tag) {
      Arg& arg = a[k++];
      using V = decltype(tag);
      if constexpr (std::is_pointer_v<V>) return reinterpret_cast<V>(arg.p);
      else if constexpr (std::is_floating_point_v<V>) return static_cast<V>(arg.f);
      else return static_cast<V>(arg.i);
    };
    // Arguments are evaluated in order in a braced initializer list.
    std::tuple<T...> values{next(T{})...};
    std::apply(kernel, values);
  };
}

#define KERNEL(NAME) {#NAME, caller(&NAME)}
// INT4 GEMV: tensor-core tiles for 16-bit x, CUDA-core tiles for float32.
#define GEMV_MMA_TILES(DT)                                                                 \
  KERNEL(int4_gemv_##DT##_m8), KERNEL(int4_gemv_##DT##_m16), KERNEL(int4_gemv_##DT##_m8_g128), \
      KERNEL(int4_gemv_##DT##_m16_g128)
#define GEMV_F32_TILES                                                                    \
  KERNEL(int4_gemv_f32_m1), KERNEL(int4_gemv_f32_m2), KERNEL(int4_gemv_f32_m4),           \
      KERNEL(int4_gemv_f32_m8), KERNEL(int4_gemv_f32_m16)
#define FUSED(DT) KERNEL(add_rms_norm_##DT), KERNEL(rope_kv_write_##DT), KERNEL(silu_and_mul_##DT)

#define DECODE(DT, KV, D)                                                                          \
  KERNEL(paged_decode_##DT##_##KV##_d##D##_g1), KERNEL(paged_decode_##DT##_##KV##_d##D##_g2),     \
      KERNEL(paged_decode_##DT##_##KV##_d##D##_g4), KERNEL(paged_decode_##DT##_##KV##_d##D##_g8), \
      KERNEL(paged_prefill_##DT##_##KV##_d##D)
#define ATTENTION(DT)                                                                              \
  DECODE(DT, kv, 64), DECODE(DT, kv, 128), DECODE(DT, i8, 64), DECODE(DT, i8, 128),                \
      KERNEL(paged_decode_reduce_##DT)

int main(int argc, char** argv) {
  const std::map<std::string, Call> kernels = {
      GEMV_MMA_TILES(f16), GEMV_MMA_TILES(bf16), GEMV_F32_TILES, KERNEL(int4_gemm_f16),
      KERNEL(int4_gemm_bf16), FUSED(f16),      FUSED(bf16),      FUSED(f32),
      ATTENTION(f16), ATTENTION(bf16)};
  if (argc < 7 || !kernels.count(argv[1])) {
    std::fprintf(stderr, "usage: run_kernel KERNEL GX GY GZ BX BY ARG... (unknown kernel?)\n");
    return 2;
  }
  std::vector<Arg> args(argc - 7);
  for (int i = 7; i < argc; ++i) {
    const std::string text = argv[i];
    Arg& arg = args[i - 7];
    if (text == "n") continue;
    const std::string value = text.substr(2);
    if (text[0] == 'o' || text[0] == 'p') {  // o:INDEX:OFFSET or p:OFFSET:FILE
      const size_t colon = value.find(':');
      const std::string first = value.substr(0, colon), rest = value.substr(colon + 1);
      if (text[0] == 'o') {
        const Arg& base = args[std::stoi(first)];
        arg.p = base.buffer->data.get() + std::stoll(rest);
        continue;
      }
      std::ifstream in(rest, std::ios::binary | std::ios::ate);
      const size_t size = in.tellg();
      in.seekg(0);
      arg.buffer = std::make_unique<Buffer>(size);
      in.read(arg.buffer->data.get(), size);
      arg.file = rest;
      arg.p = arg.buffer->data.get() + std::stoll(first);
    } else if (text[0] == 'f') {
      arg.f = std::stof(value);
    } else {
      arg.i = std::stoll(value);
    }
  }
  const dim3_t grid{unsigned(std::stoi(argv[2])), unsigned(std::stoi(argv[3])),
                    unsigned(std::stoi(argv[4]))};
  const dim3_t block{unsigned(std::stoi(argv[5])), unsigned(std::stoi(argv[6])), 1};
  const char* copies = std::getenv("AIENG_HOST_COPIES");
  host_copies_land_early = copies != nullptr && std::string(copies) == "early";
  const Call& call = kernels.at(argv[1]);
  launch(grid, block, [&] { call(args); });
  for (Arg& arg : args)
    if (!arg.file.empty()) {
      std::ofstream out(arg.file, std::ios::binary);
      out.write(arg.buffer->data.get(), arg.buffer->size);
    }
  return 0;
}
