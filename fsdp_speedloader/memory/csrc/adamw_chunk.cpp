// fsdp_speedloader::adamw_chunk_: one AdamW step over one chunk of a parameter whose moments are stored compressed
// (memory/compressed_adamw.py), in one pass over the chunk and without the interpreter lock.
//
// The torch-ops step of a chunk decodes both moments into fp32 scratch, runs torch._fused_adamw_, rounds bf16
// parameters and encodes the moments back: about twenty passes over fp32 scratch. Here each block of BLOCK elements
// is decoded into two block buffers that stay in the core's cache, stepped, and encoded, so the chunk's memory is
// read and written once. The same IEEE operations in the same order, with torch's rounding of every intermediate
// (see `update` for the fused multiply-adds its CPU kernel uses), and correctly rounded square roots: the torch-ops
// step's result bit for bit where torch.sqrt is IEEE's (on x86 builds with MKL it is MKL's, a unit in the last place
// off for a few inputs in a thousand: a code or a scale then differs, rarely).
//
// Shapes (all 1-D, contiguous, on the CPU; n = the chunk's elements, its first at a multiple of BLOCK):
//   param (n) fp32 or bf16 (updated); grad (n) the param's dtype;
//   exp_avg (n) int8 codes of sign(x) sqrt(|x|) or bf16; exp_avg_sq (n) uint8 codes of x^(1/4) or bf16;
//   exp_avg_scale, exp_avg_sq_scale (ceil(n / BLOCK)) fp32, int8 codes only;
//   noise_key (optional): a bf16 param is rounded stochastically with 16 random bits per element, computed here
//   from the key and the element's position in the whole parameter (position + i), as bf16_master.random_bits
//   computes them (see `random_bits` below); without a key, to nearest.
// Registered as a torch.library op: a call through torch.ops releases the interpreter lock while the kernel runs.
//
// Built at first use by torch.utils.cpp_extension with -O3 -ffp-contract=off (no multiply-add contracted behind the
// code's back: the fused ones are written out) for the baseline instruction set, so that a cached build runs on any
// machine of the architecture; on x86 the same code is compiled a second time for AVX2 + FMA and chosen at run time.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>

#if defined(__GNUC__)
#define FSL_INLINE inline __attribute__((always_inline))
#else
#define FSL_INLINE inline
#endif
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define FSL_X86_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 2048;  // compressed_adamw.BLOCK

enum class Moments { kInt8, kBf16 };
enum class Param { kFp32, kBf16Nearest, kBf16Stochastic };

// torch._fused_adamw_'s scalars, computed as its CPU kernel computes them: in double, then rounded to float.
struct Coefficients {
  float decay;          // 1 - lr * weight_decay when weight_decay != 0, else 1 (p * 1 is p, bit for bit)
  float lerp_coeff;     // exp_avg.lerp_(grad, 1 - beta1) as coeff * (grad - exp_avg) + base ...
  bool lerp_from_avg;   // ... base = exp_avg when |1 - beta1| < 0.5, else grad (and coeff = (1 - beta1) - 1)
  float beta2;
  float sq_coeff;       // 1 - beta2
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
};

Coefficients coefficients(double lr, double beta1, double beta2, double weight_decay, double eps, double step) {
  Coefficients c;
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  const double step_size = lr / bias_correction1;
  c.decay = weight_decay != 0.f ? static_cast<float>(1 - lr * weight_decay) : 1.f;
  const float weight = static_cast<float>(1 - beta1);
  c.lerp_from_avg = std::abs(weight) < 0.5f;
  c.lerp_coeff = c.lerp_from_avg ? weight : weight - 1.f;
  c.beta2 = static_cast<float>(beta2);
  c.sq_coeff = static_cast<float>(1 - beta2);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-step_size);
  return c;
}

FSL_INLINE float as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

FSL_INLINE uint32_t as_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

FSL_INLINE float bf16_to_float(uint16_t h) {
  return as_float(static_cast<uint32_t>(h) << 16);
}

// (Branch-free, so that the loops around them vectorize.)
FSL_INLINE uint32_t is_nan(uint32_t u) {
  return static_cast<uint32_t>((u & 0x7FFFFFFFu) > 0x7F800000u);
}

// torch's fp32 -> bf16 conversion: round to nearest even; a NaN becomes 0xFFFF, as its vectorized conversion gives.
FSL_INLINE uint16_t bf16_nearest(float f) {
  const uint32_t u = as_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(rounded | (0u - is_nan(u)));
}

// memory/bf16_master.stochastic_round_: 16 random bits added to the lower half, which is then dropped (a carry
// rounds up, with probability the fraction of a step); infinities and NaNs converted as they are (an infinity's
// lower half is zero: dropping it is the conversion).
FSL_INLINE uint16_t bf16_stochastic(float f, int32_t bits) {
  const uint32_t u = as_bits(f);
  const uint32_t finite = static_cast<uint32_t>((u & 0x7F800000u) != 0x7F800000u);
  const uint32_t rounded = (u + (static_cast<uint32_t>(bits) & (0u - finite))) >> 16;
  return static_cast<uint16_t>(rounded | (0u - is_nan(u)));
}

// memory/bf16_master.random_bits: element i's 16 bits are the top 16 of SplitMix64's output number position + i + 1
// from the state `key` (Steele, Lea & Flood 2014: the state advances by the golden-ratio increment, each output is
// the state through the variant-13 64-bit finalizer). A counter-based generator: any element's bits without the
// ones before it, so a chunk computes its own. The finalizer's last xor-shift (z ^= z >> 31) leaves the top 16 bits
// as they are and is left out. Unsigned 64-bit arithmetic wraps, as the torch-ops copy's int64 arithmetic does.
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

FSL_INLINE void random_bits(uint64_t key, int64_t position, int32_t* __restrict bits, int64_t count) {
  const uint64_t base = key + static_cast<uint64_t>(position + 1) * kGolden;
  for (int64_t i = 0; i < count; ++i) {
    uint64_t z = base + static_cast<uint64_t>(i) * kGolden;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    bits[i] = static_cast<int32_t>(z >> 48);
  }
}

// A code from a scaled value: rounded half to even (torch.round: nearbyint under the default rounding mode); a NaN
// gives code 0, as torch's float -> int8 / uint8 conversion does.
FSL_INLINE float code_of(float scaled) {
  const float r = std::nearbyint(scaled);
  return r == r ? r : 0.f;
}

// --- int8 codes, as compressed_adamw._decode_signed / _decode_sqrt / _encode_signed / _encode_sqrt ------------------

FSL_INLINE void decode_signed(const int8_t* q, float scale, float* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const float y = static_cast<float>(q[i]) * scale;
    out[i] = y * std::fabs(y);  // sign(y) y^2
  }
}

FSL_INLINE void decode_sqrt(const uint8_t* q, float scale, float* out, int64_t count) {
  const float half = scale * 0.5f;  // code 0 in a non-zero block: half a step
  for (int64_t i = 0; i < count; ++i) {
    float y = static_cast<float>(q[i]) * scale;
    y = y < half ? half : y;  // torch.maximum: a NaN stays
    y = y * y;
    out[i] = y * y;
  }
}

// The largest of non-negative floats (or NaN), compared as integers: their bit patterns order as the values do, and a
// NaN (its sign cleared) exceeds them all, so it propagates as torch.amax's does.
FSL_INLINE float peak_of(const float* x, int64_t count) {
  uint32_t peak = 0;
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t u = as_bits(x[i]) & 0x7FFFFFFFu;
    peak = u > peak ? u : peak;
  }
  return as_float(peak);
}

// q = round(x * (levels / max(peak, tiny))), scale = peak / levels, the factor taken as torch takes it:
// reciprocal first, then times levels.
template <typename Code>
FSL_INLINE void encode(const float* x, Code* q, float* scale, float levels, int64_t count) {
  const float peak = peak_of(x, count);
  *scale = peak / levels;
  const float tiny = std::numeric_limits<float>::min();
  const float factor = (1.f / (peak < tiny ? tiny : peak)) * levels;
  for (int64_t i = 0; i < count; ++i) {
    q[i] = static_cast<Code>(static_cast<int32_t>(code_of(x[i] * factor)));
  }
}

// exp_avg: codes of sign(x) sqrt(|x|). The buffer keeps sign(x) sqrt(|x|) (the magnitude times the factor, then
// the sign, as torch orders it, is the same product: IEEE multiplication rounds both signs alike).
FSL_INLINE void encode_signed(float* x, int8_t* q, float* scale, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    x[i] = std::copysign(std::sqrt(std::fabs(x[i])), x[i]);
  }
  encode(x, q, scale, 127.f, count);
}

// exp_avg_sq: codes of x^(1/4), from sqrt(x) (the update's, which it took for its denominator).
FSL_INLINE void encode_sqrt(float* x_sqrt, uint8_t* q, float* scale, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    x_sqrt[i] = std::sqrt(x_sqrt[i]);
  }
  encode(x_sqrt, q, scale, 255.f, count);
}

// --- the AdamW update, torch._fused_adamw_'s CPU arithmetic ----------------------------------------------------------
//
// torch's kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp) writes exp_avg's lerp as a fused multiply-add
// (vec::fmadd) and its exp_avg_sq update as exp_avg_sq * beta2 + (1 - beta2) * grad * grad, which the compiler of
// torch's vectorized builds (AVX2, AVX512) contracted into one: fma((1 - beta2) * grad, grad, exp_avg_sq * beta2)
// in its vector loops, fma(exp_avg_sq, beta2, (1 - beta2) * grad * grad) in its scalar loop, which takes a chunk's
// last n % 8 elements (AVX512's vector loop is 16 wide, but the compiler vectorized the rest 8 at a time, contracted
// as the vector loop is). `kFma` false: torch's build for no vector instructions, every product rounded. The caller
// says which elements torch's scalar loop takes (`kScalarLoop`).
template <bool kFma, bool kScalarLoop, bool kLerpFromAvg, Param kParam>
FSL_INLINE void update_loop(void* param, const void* grad, const int32_t* __restrict bits, float* __restrict m,
                       float* __restrict v, float* __restrict v_sqrt, int64_t count,
                       const Coefficients& coefficients) {
  float* __restrict p32 = static_cast<float*>(param);
  const float* __restrict g32 = static_cast<const float*>(grad);
  uint16_t* __restrict p16 = static_cast<uint16_t*>(param);
  const uint16_t* __restrict g16 = static_cast<const uint16_t*>(grad);
  const Coefficients c = coefficients;  // a local copy: the stores below cannot change it, so the loop vectorizes
  for (int64_t i = 0; i < count; ++i) {
    float p = kParam == Param::kFp32 ? p32[i] : bf16_to_float(p16[i]);
    const float g = kParam == Param::kFp32 ? g32[i] : bf16_to_float(g16[i]);
    p = p * c.decay;
    const float base = kLerpFromAvg ? m[i] : g;
    const float diff = g - m[i];
    const float m_new = kFma ? std::fma(c.lerp_coeff, diff, base) : c.lerp_coeff * diff + base;
    float v_new;
    if (!kFma) {
      v_new = v[i] * c.beta2 + c.sq_coeff * g * g;
    } else if (kScalarLoop) {
      v_new = std::fma(v[i], c.beta2, c.sq_coeff * g * g);
    } else {
      v_new = std::fma(c.sq_coeff * g, g, v[i] * c.beta2);
    }
    const float root = std::sqrt(v_new);
    const float denom = root / c.bias_correction2_sqrt + c.eps;
    p = p + c.neg_step_size * m_new / denom;
    if (kParam == Param::kFp32) {
      p32[i] = p;
    } else if (kParam == Param::kBf16Nearest) {
      p16[i] = bf16_nearest(p);
    } else {
      p16[i] = bf16_stochastic(p, bits[i]);
    }
    m[i] = m_new;
    v[i] = v_new;
    v_sqrt[i] = root;
  }
}

// (The lerp's base a template argument: a select on a run-time flag keeps the compiler from vectorizing the loop.)
template <bool kFma, bool kScalarLoop, Param kParam>
FSL_INLINE void update(void* param, const void* grad, const int32_t* bits, float* m, float* v, float* v_sqrt,
                       int64_t count, const Coefficients& c) {
  if (c.lerp_from_avg) {
    update_loop<kFma, kScalarLoop, true, kParam>(param, grad, bits, m, v, v_sqrt, count, c);
  } else {
    update_loop<kFma, kScalarLoop, false, kParam>(param, grad, bits, m, v, v_sqrt, count, c);
  }
}

struct Chunk {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  float* exp_avg_scale;
  float* exp_avg_sq_scale;
  uint64_t noise_key;  // kBf16Stochastic: the random bits' key ...
  int64_t position;    // ... and the chunk's first element's position in its parameter
  int64_t numel;
  int64_t scalar_loop_from;  // the first element torch's kernel steps in its scalar loop: n - n % scalar_tail
  bool fma;
  Moments moments;
  Param param_kind;
  Coefficients c;
};

template <bool kFma, Param kParam>
FSL_INLINE void update_range(const Chunk& a, int64_t start, float* m, float* v, float* v_sqrt, int64_t count) {
  const int64_t element_size = kParam == Param::kFp32 ? 4 : 2;
  const int64_t vector_count = std::clamp<int64_t>(a.scalar_loop_from - start, 0, count);
  char* param = static_cast<char*>(a.param) + start * element_size;
  const char* grad = static_cast<const char*>(a.grad) + start * element_size;
  alignas(64) int32_t block_bits[kParam == Param::kBf16Stochastic ? kBlock : 1];
  const int32_t* bits = nullptr;
  if constexpr (kParam == Param::kBf16Stochastic) {
    random_bits(a.noise_key, a.position + start, block_bits, count);
    bits = block_bits;
  }
  update<kFma, false, kParam>(param, grad, bits, m, v, v_sqrt, vector_count, a.c);
  if (vector_count < count) {
    update<kFma, true, kParam>(param + vector_count * element_size, grad + vector_count * element_size,
                               bits != nullptr ? bits + vector_count : nullptr, m + vector_count, v + vector_count,
                               v_sqrt + vector_count, count - vector_count, a.c);
  }
}

template <bool kFma>
FSL_INLINE void update_block(const Chunk& a, int64_t start, float* m, float* v, float* v_sqrt, int64_t count) {
  switch (a.param_kind) {
    case Param::kFp32:
      update_range<kFma, Param::kFp32>(a, start, m, v, v_sqrt, count);
      break;
    case Param::kBf16Nearest:
      update_range<kFma, Param::kBf16Nearest>(a, start, m, v, v_sqrt, count);
      break;
    case Param::kBf16Stochastic:
      update_range<kFma, Param::kBf16Stochastic>(a, start, m, v, v_sqrt, count);
      break;
  }
}

FSL_INLINE void step_blocks(const Chunk& a, int64_t first_block, int64_t end_block) {
  alignas(64) float m[kBlock];
  alignas(64) float v[kBlock];
  alignas(64) float v_sqrt[kBlock];  // sqrt(exp_avg_sq): the update's denominator takes it, and so does its code
  for (int64_t b = first_block; b < end_block; ++b) {
    const int64_t start = b * kBlock;
    const int64_t count = std::min(kBlock, a.numel - start);
    if (a.moments == Moments::kInt8) {
      decode_signed(static_cast<const int8_t*>(a.exp_avg) + start, a.exp_avg_scale[b], m, count);
      decode_sqrt(static_cast<const uint8_t*>(a.exp_avg_sq) + start, a.exp_avg_sq_scale[b], v, count);
    } else {
      const uint16_t* m16 = static_cast<const uint16_t*>(a.exp_avg) + start;
      const uint16_t* v16 = static_cast<const uint16_t*>(a.exp_avg_sq) + start;
      for (int64_t i = 0; i < count; ++i) {
        m[i] = bf16_to_float(m16[i]);
        v[i] = bf16_to_float(v16[i]);
      }
    }
    if (a.fma) {
      update_block<true>(a, start, m, v, v_sqrt, count);
    } else {
      update_block<false>(a, start, m, v, v_sqrt, count);
    }
    if (a.moments == Moments::kInt8) {
      encode_signed(m, static_cast<int8_t*>(a.exp_avg) + start, a.exp_avg_scale + b, count);
      encode_sqrt(v_sqrt, static_cast<uint8_t*>(a.exp_avg_sq) + start, a.exp_avg_sq_scale + b, count);
    } else {
      uint16_t* m16 = static_cast<uint16_t*>(a.exp_avg) + start;
      uint16_t* v16 = static_cast<uint16_t*>(a.exp_avg_sq) + start;
      for (int64_t i = 0; i < count; ++i) {
        m16[i] = bf16_nearest(m[i]);
        v16[i] = bf16_nearest(v[i]);
      }
    }
  }
}

void step_blocks_baseline(const Chunk& a, int64_t first_block, int64_t end_block) {
  step_blocks(a, first_block, end_block);
}

#ifdef FSL_X86_AVX2
__attribute__((target("avx2,fma"))) void step_blocks_avx2(const Chunk& a, int64_t first_block, int64_t end_block) {
  step_blocks(a, first_block, end_block);
}

bool has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

void check_operand(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 1 && t.numel() == numel, "adamw_chunk_: ",
              name, " must be a contiguous 1-D CPU tensor of ", numel, " elements; got ", t.sizes(), " on ",
              t.device());
}

void adamw_chunk_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& exp_avg_scale,
                  const std::optional<at::Tensor>& exp_avg_sq_scale, std::optional<int64_t> noise_key,
                  int64_t position, double lr, double beta1, double beta2, double weight_decay, double eps, double step,
                  int64_t scalar_tail, bool fma) {
  const int64_t n = param.numel();
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  for (auto [t, name] : {std::pair{&param, "param"}, {&grad, "grad"}, {&exp_avg, "exp_avg"},
                         {&exp_avg_sq, "exp_avg_sq"}}) {
    check_operand(*t, name, n);
  }
  TORCH_CHECK(param.scalar_type() == at::kFloat || param.scalar_type() == at::kBFloat16,
              "adamw_chunk_: fp32 or bf16 parameters; got ", param.scalar_type());
  TORCH_CHECK(grad.scalar_type() == param.scalar_type(), "adamw_chunk_: the gradient's dtype ", grad.scalar_type(),
              " differs from the parameter's ", param.scalar_type());
  Chunk a;
  if (exp_avg.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(exp_avg_sq.scalar_type() == at::kBFloat16 && !exp_avg_scale && !exp_avg_sq_scale,
                "adamw_chunk_: bf16 moments take no scales");
    a.moments = Moments::kBf16;
    a.exp_avg_scale = a.exp_avg_sq_scale = nullptr;
  } else {
    TORCH_CHECK(exp_avg.scalar_type() == at::kChar && exp_avg_sq.scalar_type() == at::kByte && exp_avg_scale &&
                    exp_avg_sq_scale,
                "adamw_chunk_: moments as int8 and uint8 codes with their scales, or both bf16; got ",
                exp_avg.scalar_type(), " and ", exp_avg_sq.scalar_type());
    for (auto [t, name] : {std::pair{&*exp_avg_scale, "exp_avg_scale"}, {&*exp_avg_sq_scale, "exp_avg_sq_scale"}}) {
      check_operand(*t, name, blocks);
      TORCH_CHECK(t->scalar_type() == at::kFloat, "adamw_chunk_: ", name, " must be fp32");
    }
    a.moments = Moments::kInt8;
    a.exp_avg_scale = exp_avg_scale->data_ptr<float>();
    a.exp_avg_sq_scale = exp_avg_sq_scale->data_ptr<float>();
  }
  a.noise_key = 0;
  TORCH_CHECK(position >= 0, "adamw_chunk_: position must be non-negative; got ", position);
  a.position = position;
  if (param.scalar_type() == at::kFloat) {
    TORCH_CHECK(!noise_key, "adamw_chunk_: stochastic rounding (a noise_key) rounds bf16 parameters only");
    a.param_kind = Param::kFp32;
  } else if (noise_key) {
    a.param_kind = Param::kBf16Stochastic;
    a.noise_key = static_cast<uint64_t>(*noise_key);
  } else {
    a.param_kind = Param::kBf16Nearest;
  }
  TORCH_CHECK(scalar_tail > 0, "adamw_chunk_: scalar_tail must be positive");
  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.exp_avg = exp_avg.data_ptr();
  a.exp_avg_sq = exp_avg_sq.data_ptr();
  a.numel = n;
  a.scalar_loop_from = n - n % scalar_tail;
  a.fma = fma;
  a.c = coefficients(lr, beta1, beta2, weight_decay, eps, step);
  // One thread steps the chunk: the chunks are the unit of parallelism (the optimizer's pool runs one per thread).
#ifdef FSL_X86_AVX2
  if (has_avx2_fma()) {
    step_blocks_avx2(a, 0, blocks);
    return;
  }
#endif
  step_blocks_baseline(a, 0, blocks);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fsdp_speedloader, m) {
  m.def(
      "adamw_chunk_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? exp_avg_scale, Tensor(e!)? exp_avg_sq_scale, int? noise_key, int position, float lr, float beta1, float beta2, "
      "float weight_decay, float eps, float step, int scalar_tail, bool fma) -> ()");
  m.impl("adamw_chunk_", c10::DispatchKey::CPU, &adamw_chunk_);
}
