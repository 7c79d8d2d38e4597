// RESplit's encoder for a run of experts of one routed-expert tensor, in C++ so that conversion is not bound by numpy:
// source rows (F32/F16/BF16/Q8_0) -> float32 through ggml's own conversions, then either
//   residual / copy: WQ = q(W), WR = q(W - deq(WQ)) (or q(W) for down's copy), every (de)quantization ggml's own
//                    (ggml_quantize_chunk and the type traits' to_float), so the residual is taken against exactly
//                    what the kernels dequantize; or
//   refine:          the "q3k-refine1" codec, a transliteration of python/rapidmoe/resplit/refine.py (the
//                    reference): the same float32 operations in the same order (no fused multiply-adds: this file
//                    is built with -ffp-contract=off; 16-term sums in refine.sum16's tree), so the bytes are the
//                    reference's bit for bit (tests/conversion/test_parallel_convert.py compares them).
// It also returns the sums of squares the conversion report needs (float64), and the reference types' errors on the
// sampled experts. One call runs on the calling thread with the GIL released; conversion runs several at once.
#include "encode.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "ggml.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace rapidmoe {
namespace {

using F32Rows      = nb::ndarray<const float, nb::numpy, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F32Vec       = nb::ndarray<const float, nb::numpy, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using BytesRows    = nb::ndarray<const uint8_t, nb::numpy, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using MutBytesRows = nb::ndarray<uint8_t, nb::numpy, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// -- the refine codec (refine.py) ------------------------------------------------------------------------------
constexpr int QK = 256;          // weights per Q3_K super-block
constexpr int SUB = 16;          // weights per sub-block
constexpr int NSUB = QK / SUB;   // sub-blocks per super-block
constexpr int BLOCK_BYTES = 110; // sizeof(block_q3_K)
// refine.SCALE_MULTIPLIERS and LS_ROUNDS, as numpy's float32 of each Python float
constexpr float MULTS[] = { 0.9f, 0.95f, 1.0f, 1.05f, 1.1f, 1.15f, 1.2f, 1.25f, 1.3f };
constexpr int LS_ROUNDS = 2;

// refine.sum16: (x[j] + x[j+8]), then (+4), (+2), (+1)
inline float sum16(const float * x) {
    float a[8], b[4];
    for (int j = 0; j < 8; ++j) a[j] = x[j] + x[j + 8];
    for (int j = 0; j < 4; ++j) b[j] = a[j] + a[j + 4];
    const float c0 = b[0] + b[2], c1 = b[1] + b[3];
    return c0 + c1;
}

// refine._fine_index for one weight: inv = 4/s (0 where s == 0)
inline float fine_index(float w, float inv) {
    const float f = std::nearbyint((w * inv + 17.0f) * 0.5f);  // np.rint: half to even (the default rounding)
    return f < 0.0f ? 0.0f : (f > 15.0f ? 15.0f : f);
}

inline float inverse4(float s) { return s != 0.0f ? 4.0f / s : 0.0f; }

// refine.fit_sub_scales for one sub-block
float fit_sub_scale(const float * w, const float * c) {
    int imax = 0;
    float amax = std::fabs(w[0]);
    for (int i = 1; i < SUB; ++i) {
        if (std::fabs(w[i]) > amax) {  // np.argmax: the first of equal maxima
            amax = std::fabs(w[i]);
            imax = i;
        }
    }
    const float s0 = (float) (-4.0 / 17.0) * w[imax];
    float best_s = s0, best_err = INFINITY;
    float q[SUB], t[SUB], u[SUB];
    for (float mult : MULTS) {
        float s = s0 * mult;
        for (int r = 0;; ++r) {
            const float inv = inverse4(s), s4 = s * 0.25f;
            for (int i = 0; i < SUB; ++i) {
                q[i] = 2.0f * fine_index(w[i], inv) - 17.0f;
                const float e = w[i] - s4 * q[i];
                t[i] = c[i] * (e * e);
            }
            const float err = sum16(t);
            if (err < best_err) {
                best_err = err;
                best_s = s;
            }
            if (r == LS_ROUNDS) {
                break;
            }
            for (int i = 0; i < SUB; ++i) {
                const float cq = c[i] * q[i];
                t[i] = cq * w[i];
                u[i] = cq * q[i];
            }
            const float num = sum16(t), den = sum16(u);
            if (den > 0.0f) {
                s = (4.0f * num) / den;
            }
        }
    }
    return best_s;
}

// refine.encode_refine for one super-block (256 weights w, their error weights c): block_q3_K bytes, the 32 bytes
// of refinement bits, and (for the report) the base and refined values as decode_refine gives them
void refine_block(const float * w, const float * c, uint8_t * blk, uint8_t * bits, float * base, float * refined) {
    float s[NSUB];
    for (int j = 0; j < NSUB; ++j) {
        s[j] = fit_sub_scale(w + SUB * j, c + SUB * j);
    }
    float amax = std::fabs(s[0]);
    for (int j = 1; j < NSUB; ++j) {
        amax = std::fmax(amax, std::fabs(s[j]));
    }
    const ggml_fp16_t d16 = ggml_fp32_to_fp16(amax / 31.0f);
    const float d32 = ggml_fp16_to_fp32(d16);
    int sc[NSUB];
    uint8_t lv[QK], f[QK];
    for (int j = 0; j < NSUB; ++j) {
        const float ratio = d32 != 0.0f ? s[j] / d32 : 0.0f;
        const float rr = std::nearbyint(ratio);
        sc[j] = (int) (rr < -32.0f ? -32.0f : (rr > 31.0f ? 31.0f : rr));
        const float sq = d32 * (float) sc[j];
        const float inv = inverse4(sq), s4 = sq * 0.25f;
        for (int i = 0; i < SUB; ++i) {
            const int k = SUB * j + i;
            f[k] = (uint8_t) fine_index(w[k], inv);
            lv[k] = f[k] >> 1;
            base[k] = sq * (float) ((int) lv[k] - 4);
            refined[k] = s4 * (2.0f * (float) f[k] - 17.0f);
        }
    }
    std::memset(blk, 0, BLOCK_BYTES);
    uint8_t * hmask = blk, * qs = blk + 32, * scales = blk + 96;
    for (int k = 0; k < QK; ++k) {
        if (lv[k] > 3) {
            hmask[k % 32] |= (uint8_t) (1u << (k / 32));
        }
        const int h = k / 128, kk = (k % 128) / 32, l = k % 32;
        qs[32 * h + l] |= (uint8_t) ((lv[k] & 3) << (2 * kk));
    }
    uint8_t uu[NSUB];
    for (int j = 0; j < NSUB; ++j) {
        uu[j] = (uint8_t) (sc[j] + 32);
    }
    for (int j = 0; j < 8; ++j) {
        scales[j] = (uint8_t) ((uu[j] & 0xF) | ((uu[j + 8] & 0xF) << 4));
    }
    for (int j = 0; j < NSUB; ++j) {
        scales[8 + j % 4] |= (uint8_t) ((uu[j] >> 4) << (2 * (j / 4)));
    }
    std::memcpy(blk + 108, &d16, 2);
    for (int b = 0; b < QK / 8; ++b) {
        uint8_t byte = 0;
        for (int i = 0; i < 8; ++i) {
            byte |= (uint8_t) ((f[8 * b + i] & 1) << i);
        }
        bits[b] = byte;
    }
}

// W [n_out, n_in] -> Q3_K rows [n_out, n_in / 256 * 110], bits [n_out, n_in / 8], base and refined [n_out, n_in]
void refine_rows(const float * w, int64_t n_out, int64_t n_in, const float * imp, uint8_t * q, uint8_t * bits,
                 float * base, float * refined) {
    float c[QK];
    const int64_t nb = n_in / QK;
    for (int64_t r = 0; r < n_out; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t at = r * n_in + b * QK;
            for (int i = 0; i < QK; ++i) {
                const float a = std::fabs(w[at + i]);
                c[i] = imp != nullptr ? a * imp[b * QK + i] : a;
            }
            refine_block(w + at, c, q + (r * nb + b) * BLOCK_BYTES, bits + r * (n_in / 8) + b * (QK / 8),
                         base + at, refined + at);
        }
    }
}

// -- ggml's own conversions ------------------------------------------------------------------------------------
ggml_type checked_type(int type) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_get_type_traits((ggml_type) type)->blck_size == 0) {
        throw std::invalid_argument("unknown ggml type id " + std::to_string(type));
    }
    return (ggml_type) type;
}

void check_row(ggml_type type, int64_t n_in) {
    if (n_in <= 0 || n_in % ggml_blck_size(type) != 0) {
        throw std::invalid_argument(std::string(ggml_type_name(type)) + " needs rows that are a multiple of " +
                                    std::to_string(ggml_blck_size(type)) + " values; got " + std::to_string(n_in));
    }
}

void to_f32(ggml_type type, const uint8_t * src, float * dst, int64_t n) {
    if (type == GGML_TYPE_F32) {
        std::memcpy(dst, src, (size_t) n * sizeof(float));
    } else if (type == GGML_TYPE_F16) {
        ggml_fp16_to_fp32_row((const ggml_fp16_t *) src, dst, n);
    } else {
        ggml_get_type_traits(type)->to_float(src, dst, n);
    }
}

void quantize(ggml_type type, const float * w, uint8_t * q, int64_t n_out, int64_t n_in, const float * imat) {
    ggml_quantize_chunk(type, w, q, 0, n_out, n_in, imat);
}

double sq_diff(const float * a, const float * b, int64_t n) {  // sum (a - b)^2: the difference in float32
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        const double d = (double) (a[i] - b[i]);
        s += d * d;
    }
    return s;
}

double sq(const float * a, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        s += (double) a[i] * (double) a[i];
    }
    return s;
}

enum Mode { RESIDUAL = 0, COPY = 1, REFINE = 2 };

struct Scratch {  // one thread's buffers: bounded by one expert
    std::vector<float> w, wq, crit, tmp;
    std::vector<uint8_t> q;
};
thread_local Scratch g_scratch;

nb::tuple encode_experts(BytesRows src, int src_type, int64_t n_in, int64_t n_out, int mode, int wq_type,
                         int hi_type, MutBytesRows wq_out, MutBytesRows hi_out, std::optional<F32Rows> imatrix,
                         std::vector<int> ref_types, std::vector<bool> sampled) {
    const ggml_type st = checked_type(src_type);
    check_row(st, n_in);
    if (mode < RESIDUAL || mode > REFINE) {
        throw std::invalid_argument("mode must be 0 (residual), 1 (copy) or 2 (refine)");
    }
    const int64_t n_exp = (int64_t) sampled.size();
    const size_t src_row = ggml_row_size(st, n_in);
    if (n_out <= 0 || (int64_t) src.shape(0) != n_exp * n_out || src.shape(1) != src_row) {
        throw std::invalid_argument("source rows must be [n_expert * n_out, row bytes of the source type]");
    }
    ggml_type wt = GGML_TYPE_Q3_K, ht = GGML_TYPE_I8;
    size_t wq_row = 0, hi_row = 0;
    if (mode == REFINE) {
        if (n_in % QK != 0) {
            throw std::invalid_argument("the refine codec needs rows that are whole Q3_K super-blocks of 256");
        }
        wq_row = (size_t) (n_in / QK) * BLOCK_BYTES;
        hi_row = (size_t) n_in / 8;
    } else {
        wt = checked_type(wq_type);
        ht = checked_type(hi_type);
        check_row(wt, n_in);
        check_row(ht, n_in);
        wq_row = ggml_row_size(wt, n_in);
        hi_row = ggml_row_size(ht, n_in);
        for (ggml_type t : { wt, ht }) {
            if (ggml_quantize_requires_imatrix(t) && !imatrix.has_value()) {
                throw std::invalid_argument(std::string(ggml_type_name(t)) + " requires an importance matrix");
            }
        }
    }
    if ((int64_t) wq_out.shape(0) != n_exp * n_out || wq_out.shape(1) != wq_row ||
        (int64_t) hi_out.shape(0) != n_exp * n_out || hi_out.shape(1) != hi_row) {
        throw std::invalid_argument("output rows must be [n_expert * n_out, row bytes of the WQ / sidecar type]");
    }
    if (imatrix.has_value() && ((int64_t) imatrix->shape(0) != n_exp || (int64_t) imatrix->shape(1) != n_in)) {
        throw std::invalid_argument("imatrix must be [n_expert, n_in]");
    }
    std::vector<ggml_type> refs;
    for (int t : ref_types) {
        refs.push_back(checked_type(t));
        check_row(refs.back(), n_in);
    }
    if (mode != REFINE) {
        ggml_quantize_init(wt);
        ggml_quantize_init(ht);
    }
    for (ggml_type t : refs) {
        ggml_quantize_init(t);
    }
    double w2 = 0, wq2 = 0, crit2 = 0, ref_w2 = 0;
    std::vector<double> ref2(refs.size(), 0.0);
    {
        nb::gil_scoped_release release;
        Scratch & s = g_scratch;
        const int64_t n = n_out * n_in;
        s.w.resize(n);
        s.wq.resize(n);
        s.crit.resize(n);
        s.tmp.resize(n);
        size_t q_bytes = 0;
        for (ggml_type t : refs) {
            q_bytes = std::max(q_bytes, ggml_row_size(t, n_in) * (size_t) n_out);
        }
        s.q.resize(std::max<size_t>(q_bytes, 1));
        for (int64_t e = 0; e < n_exp; ++e) {
            const float * im = imatrix.has_value() ? imatrix->data() + e * n_in : nullptr;
            to_f32(st, src.data() + (size_t) e * n_out * src_row, s.w.data(), n);
            uint8_t * wq = wq_out.data() + (size_t) e * n_out * wq_row;
            uint8_t * hi = hi_out.data() + (size_t) e * n_out * hi_row;
            if (mode == REFINE) {
                refine_rows(s.w.data(), n_out, n_in, im, wq, hi, s.wq.data(), s.crit.data());
            } else {
                const auto * wtr = ggml_get_type_traits(wt), * htr = ggml_get_type_traits(ht);
                quantize(wt, s.w.data(), wq, n_out, n_in, im);
                wtr->to_float(wq, s.wq.data(), n);
                if (mode == COPY) {
                    quantize(ht, s.w.data(), hi, n_out, n_in, im);
                    htr->to_float(hi, s.crit.data(), n);
                } else {
                    for (int64_t i = 0; i < n; ++i) {
                        s.tmp[i] = s.w[i] - s.wq[i];
                    }
                    quantize(ht, s.tmp.data(), hi, n_out, n_in, im);
                    htr->to_float(hi, s.tmp.data(), n);
                    for (int64_t i = 0; i < n; ++i) {
                        s.crit[i] = s.wq[i] + s.tmp[i];
                    }
                }
            }
            const double we2 = sq(s.w.data(), n);
            w2 += we2;
            wq2 += sq_diff(s.w.data(), s.wq.data(), n);
            crit2 += sq_diff(s.w.data(), s.crit.data(), n);
            if (sampled[e] && !refs.empty()) {
                ref_w2 += we2;
                for (size_t k = 0; k < refs.size(); ++k) {
                    quantize(refs[k], s.w.data(), s.q.data(), n_out, n_in, im);
                    ggml_get_type_traits(refs[k])->to_float(s.q.data(), s.tmp.data(), n);
                    ref2[k] += sq_diff(s.w.data(), s.tmp.data(), n);
                }
            }
        }
    }
    return nb::make_tuple(w2, wq2, crit2, ref_w2, ref2);
}

nb::tuple refine_encode(F32Rows w, std::optional<F32Vec> importance) {
    const int64_t n_out = (int64_t) w.shape(0), n_in = (int64_t) w.shape(1);
    if (n_in <= 0 || n_in % QK != 0) {
        throw std::invalid_argument("the refine codec needs rows that are whole Q3_K super-blocks of 256; these "
                                    "rows have " + std::to_string(n_in));
    }
    if (importance.has_value() && (int64_t) importance->shape(0) != n_in) {
        throw std::invalid_argument("importance must have one value per column");
    }
    const size_t q_row = (size_t) (n_in / QK) * BLOCK_BYTES, b_row = (size_t) n_in / 8;
    auto * q = new uint8_t[n_out * q_row];
    auto * bits = new uint8_t[n_out * b_row];
    nb::capsule q_owner(q, [](void * p) noexcept { delete[] (uint8_t *) p; });
    nb::capsule b_owner(bits, [](void * p) noexcept { delete[] (uint8_t *) p; });
    {
        nb::gil_scoped_release release;
        std::vector<float> base(n_out * n_in), refined(n_out * n_in);
        refine_rows(w.data(), n_out, n_in, importance.has_value() ? importance->data() : nullptr, q, bits,
                    base.data(), refined.data());
    }
    return nb::make_tuple(nb::ndarray<nb::numpy, uint8_t, nb::ndim<2>>(q, { (size_t) n_out, q_row }, q_owner),
                          nb::ndarray<nb::numpy, uint8_t, nb::ndim<2>>(bits, { (size_t) n_out, b_row }, b_owner));
}

}  // namespace

void bind_encode(nb::module_ & m) {
    m.def("encode_experts", &encode_experts, "src"_a, "src_type"_a, "n_in"_a, "n_out"_a, "mode"_a, "wq_type"_a,
          "hi_type"_a, "wq_out"_a, "hi_out"_a, "imatrix"_a = nb::none(), "ref_types"_a = std::vector<int>(),
          "sampled"_a = std::vector<bool>(),
          "RESplit-encode len(sampled) experts of one routed-expert tensor on this thread (GIL released).\n"
          "src: their rows in the source type, uint8 [n_expert * n_out, row bytes]; mode 0 residual (WR = q(W -\n"
          "deq(WQ))), 1 copy (WR = q(W)), 2 refine (Q3_K base and refinement bits, refine.py's codec). Writes\n"
          "wq_out and hi_out (uint8 rows of the WQ and sidecar types). imatrix: float32 [n_expert, n_in].\n"
          "Returns (sum W^2, sum (W - WQ)^2, sum (W - critical)^2, sum W^2 over the sampled experts, [sum (W -\n"
          "ref)^2 per ref type over the sampled experts]) in float64.");
    m.def("refine_encode", &refine_encode, "w"_a, "importance"_a = nb::none(),
          "The refine codec's encode_refine, compiled: float32 W [n_out, n_in] (n_in a multiple of 256) ->\n"
          "(Q3_K bytes [n_out, n_in / 256 * 110], refinement bits [n_out, n_in / 8]); importance per column.");
}

}  // namespace rapidmoe
