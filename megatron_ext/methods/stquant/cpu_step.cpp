// STQuant's state update as one CPU pass per quantization block (see cpu_step.py): decode the
// old m, v codes, torch's AdamW step, encode the new m, v at the new width. The arithmetic is
// the Triton kernel's (triton_step.py), i.e. the torch path's op by op; built with
// -ffp-contract=off so that the only fused multiply-adds are the explicit fmaf calls.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float as_float(int32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline int32_t as_int(float f) { int32_t b; std::memcpy(&b, &f, 4); return b; }

struct Moment {  // one stored moment: codes (+ scales) at a width
  const void* codes;
  const float* scales;
  int bits;
};

struct Out {  // where a new moment goes
  void* codes;
  float* scales;
  int bits;
};

struct Scalars {
  float decay, lerp_w, beta2, omb2, bias2_sqrt, eps, neg_step;
};

// The codes of block b as int32 (16 bits: the stored int16 plus offset).
void unpack(const void* codes, int bits, int64_t b, int64_t B, int32_t offset, int32_t* k) {
  if (bits == 16) {
    const int16_t* c = static_cast<const int16_t*>(codes) + b * B;
    for (int64_t j = 0; j < B; ++j) k[j] = c[j] + offset;
  } else if (bits == 8) {
    const uint8_t* c = static_cast<const uint8_t*>(codes) + b * B;
    for (int64_t j = 0; j < B; ++j) k[j] = c[j];
  } else {  // two per byte, low nibble first
    const uint8_t* c = static_cast<const uint8_t*>(codes) + b * (B / 2);
    for (int64_t j = 0; j < B / 2; ++j) {
      k[2 * j] = c[j] & 0xF;
      k[2 * j + 1] = c[j] >> 4;
    }
  }
}

// Old m of block b into out[0, B): sign-magnitude codes times the scale (16 bits: code * s).
void load_linear(const Moment& q, int64_t b, int64_t B, int64_t lo, int64_t hi, int64_t first,
                 int32_t* k, float* out) {
  if (q.bits == 32) {
    std::fill(out, out + B, 0.0f);
    std::memcpy(out + lo, static_cast<const float*>(q.codes) + first, (hi - lo) * 4);
    return;
  }
  const float s = q.scales[b];
  unpack(q.codes, q.bits, b, B, 0, k);
  if (q.bits == 16) {
    for (int64_t j = 0; j < B; ++j) out[j] = static_cast<float>(k[j]) * s;
    return;
  }
  const int32_t mask = (1 << (q.bits - 1)) - 1, sign = q.bits - 1;
  for (int64_t j = 0; j < B; ++j) {
    const float mag = static_cast<float>(k[j] & mask) * s;
    out[j] = (k[j] >> sign) ? -mag : mag;
  }
}

// Old v of block b: vmax * rungs[k] (16 bits: rungs holds the top octave's 2048 rungs).
void load_log(const Moment& q, const float* rungs, int64_t b, int64_t B, int64_t lo, int64_t hi,
              int64_t first, int32_t* k, float* out) {
  if (q.bits == 32) {
    std::fill(out, out + B, 0.0f);
    std::memcpy(out + lo, static_cast<const float*>(q.codes) + first, (hi - lo) * 4);
    return;
  }
  const float vmax = q.scales[b];
  if (q.bits == 16) {  // rungs[k] = 2**-(t >> 11) * rungs[K - (t & 2047)], t = K - k (exact)
    const int16_t* c = static_cast<const int16_t*>(q.codes) + b * B;
    for (int64_t j = 0; j < B; ++j) {
      const int32_t t = 32767 - c[j];
      const float rung = as_float((127 - (t >> 11)) << 23) * rungs[t & 2047];
      out[j] = c[j] == -32768 ? 0.0f : vmax * rung;
    }
    return;
  }
  unpack(q.codes, q.bits, b, B, 0, k);
  for (int64_t j = 0; j < B; ++j) out[j] = vmax * rungs[k[j]];
}

// The AdamW update of one block (ATen's CPU kernels, as the Triton kernel spells them out).
void adamw(const Scalars& s, int64_t B, float* p, const float* g, float* m, float* v) {
  const bool decay = s.decay != 1.0f, small = std::fabs(s.lerp_w) < 0.5f;
  const float w1 = s.lerp_w - 1.0f;
  for (int64_t j = 0; j < B; ++j) {
    const float pj = decay ? p[j] * s.decay : p[j];
    const float d = g[j] - m[j];
    m[j] = small ? fmaf(d, s.lerp_w, m[j]) : fmaf(d, w1, g[j]);
    v[j] = fmaf(s.omb2 * g[j], g[j], v[j] * s.beta2);
    const float denom = std::sqrt(v[j]) / s.bias2_sqrt + s.eps;
    p[j] = pj + (s.neg_step * m[j]) / denom;
  }
}

// Largest |x| of the block, exactly (on the bits: |x| orders as its int32 bits).
inline float amax_of(const float* x, int64_t B) {
  int32_t top = 0;
  for (int64_t j = 0; j < B; ++j) top = std::max(top, as_int(x[j]) & 0x7FFFFFFF);
  return as_float(top);
}

void store_codes(const Out& o, int64_t b, int64_t B, const int32_t* k) {
  if (o.bits == 16) {
    int16_t* c = static_cast<int16_t*>(o.codes) + b * B;
    for (int64_t j = 0; j < B; ++j) c[j] = static_cast<int16_t>(k[j]);
  } else if (o.bits == 8) {
    uint8_t* c = static_cast<uint8_t*>(o.codes) + b * B;
    for (int64_t j = 0; j < B; ++j) c[j] = static_cast<uint8_t>(k[j]);
  } else {  // two per byte, low nibble first
    uint8_t* c = static_cast<uint8_t*>(o.codes) + b * (B / 2);
    for (int64_t j = 0; j < B / 2; ++j) c[j] = static_cast<uint8_t>(k[2 * j] | (k[2 * j + 1] << 4));
  }
}

// New m codes and scale: 16 bits d = amax / 32767, k = round(m / d); 4 / 8 bits the formats
// package's int<b>@row (d = amax / Q with its low b-1 significand bits cleared, >= 2**-126,
// |k| = round(m * (1/d)), the sign bit from m's).
void store_linear(const Out& o, int64_t b, int64_t B, const float* m, int32_t* k) {
  const float amax = amax_of(m, B);
  if (o.bits == 16) {
    const float d = amax / 32767.0f, safe = d > 0.0f ? d : 1.0f;
    for (int64_t j = 0; j < B; ++j)
      k[j] = static_cast<int32_t>(std::min(std::max(std::rint(m[j] / safe), -32767.0f), 32767.0f));
    o.scales[b] = d;
  } else {
    const int sign_bit = o.bits - 1;
    float d = as_float(as_int(amax / static_cast<float>((1 << sign_bit) - 1)) & -(1 << sign_bit));
    d = std::max(d, FLT_MIN);
    const float quant = 1.0f / d;
    for (int64_t j = 0; j < B; ++j) {
      const int32_t mag = static_cast<int32_t>(std::fabs(std::rint(m[j] * quant)));
      k[j] = mag | (((as_int(m[j]) >> 31) & 1) << sign_bit);
    }
    o.scales[b] = d;
  }
  store_codes(o, b, B, k);
}

// New v codes and vmax: the exact ladder. ratio = v / vmax = 2**e * f; the rungs above the
// octave's bottom are #{i: f >= cuts[i]}, read as table[top 12 bits of f] (the count at the
// bucket's start) plus one comparison (a bucket holds at most one cut).
void store_log(const Out& o, int64_t b, int64_t B, const float* v, const int32_t* table,
               const float* cuts, int32_t per_octave, int32_t* k) {
  const int32_t top = (1 << o.bits) - 1;
  const float vmax = amax_of(v, B), safe = vmax > 0.0f ? vmax : 1.0f;
  for (int64_t j = 0; j < B; ++j) {
    const int32_t bits = as_int(std::max(v[j] / safe, FLT_MIN));
    const float mant = as_float((bits & 0x7FFFFF) | 0x3F800000);
    int32_t c = table[(bits >> 11) & 0xFFF];
    c += mant >= cuts[c];
    const int32_t code = std::min(std::max(top + ((bits >> 23) - 127) * per_octave + c, 1), top);
    k[j] = v[j] > 0.0f ? code - (o.bits == 16 ? 32768 : 0) : (o.bits == 16 ? -32768 : 0);
  }
  o.scales[b] = vmax;
  store_codes(o, b, B, k);
}

}  // namespace

// Update the contiguous float32 p (numel elements, lead into its first block) in place from
// grad and write the new m, v into the preallocated outputs. scalars: decay, lerp weight,
// beta2, 1 - beta2, sqrt(bias correction 2), eps, -step size (float32 values).
void step(torch::Tensor p, torch::Tensor grad, torch::Tensor m_codes, torch::Tensor m_scales,
          int64_t old_bits, torch::Tensor v_codes, torch::Tensor v_scales, torch::Tensor m_out,
          torch::Tensor ms_out, torch::Tensor v_out, torch::Tensor vs_out, int64_t new_bits,
          torch::Tensor rungs, torch::Tensor table, torch::Tensor cuts, int64_t lead,
          int64_t block, std::vector<double> scalars) {
  TORCH_CHECK(p.is_contiguous() && grad.is_contiguous() && p.dtype() == torch::kFloat32 &&
              grad.dtype() == torch::kFloat32, "p and grad must be contiguous float32");
  TORCH_CHECK(scalars.size() == 7 && block % 2 == 0, "seven scalars and an even block");
  const int64_t numel = p.numel(), B = block;
  const int64_t nblocks = (lead + numel + B - 1) / B;
  auto ptr = [](torch::Tensor& t) { return t.numel() ? t.data_ptr() : nullptr; };
  const int old_b = static_cast<int>(old_bits);
  const Moment m{ptr(m_codes), static_cast<const float*>(ptr(m_scales)), old_b};
  const Moment v{ptr(v_codes), static_cast<const float*>(ptr(v_scales)), old_b};
  const Out mo{ptr(m_out), static_cast<float*>(ptr(ms_out)), static_cast<int>(new_bits)};
  const Out vo{ptr(v_out), static_cast<float*>(ptr(vs_out)), static_cast<int>(new_bits)};
  const Scalars s{float(scalars[0]), float(scalars[1]), float(scalars[2]), float(scalars[3]),
                  float(scalars[4]), float(scalars[5]), float(scalars[6])};
  float* P = p.data_ptr<float>();
  const float* G = grad.data_ptr<float>();
  const float* rung = static_cast<const float*>(ptr(rungs));
  const int32_t* tab = static_cast<const int32_t*>(ptr(table));
  const float* cut = static_cast<const float*>(ptr(cuts));
  const int32_t per_octave = static_cast<int32_t>(cuts.numel()) - 1;
  at::parallel_for(0, nblocks, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(4 * B);
    std::vector<int32_t> k(B);
    float *pb = buf.data(), *gb = pb + B, *mb = gb + B, *vb = mb + B;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t lo = std::max<int64_t>(0, lead - b * B);
      const int64_t hi = std::min<int64_t>(B, lead + numel - b * B);
      const int64_t first = b * B + lo - lead;  // p's index of element lo
      std::fill(pb, pb + 2 * B, 0.0f);
      std::memcpy(pb + lo, P + first, (hi - lo) * 4);
      std::memcpy(gb + lo, G + first, (hi - lo) * 4);
      load_linear(m, b, B, lo, hi, first, k.data(), mb);
      load_log(v, rung, b, B, lo, hi, first, k.data(), vb);
      adamw(s, B, pb, gb, mb, vb);
      std::memcpy(P + first, pb + lo, (hi - lo) * 4);
      if (new_bits == 32) {
        std::memcpy(static_cast<float*>(mo.codes) + first, mb + lo, (hi - lo) * 4);
        std::memcpy(static_cast<float*>(vo.codes) + first, vb + lo, (hi - lo) * 4);
      } else {
        store_linear(mo, b, B, mb, k.data());
        store_log(vo, b, B, vb, tab, cut, per_octave, k.data());
      }
    }
  });
}
