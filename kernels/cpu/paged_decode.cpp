// Decode attention over a paged, head-major KV cache in one pass over K and V.
//
// The pure-torch path gathers every request's blocks into a padded tensor and then runs two matmuls over it:
// three passes over the KV bytes, which dominate a CPU decode step. Here each (request, KV head) pair walks its
// block table directly, so K and V are read once from memory and nothing is copied.
#include <torch/extension.h>

#include <cmath>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32, "float32 tensors expected");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous tensors expected");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && seq_lens.dtype() == torch::kInt64, "int64 tables expected");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  const int64_t G = H / KVH, MB = block_tables.size(1);
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t hk = 0; hk < KVH; ++hk) {
        const int64_t L = lp[b];
        scores.assign(static_cast<size_t>(G * L), 0.f);
        const float* qb = qp + (b * H + hk * G) * D;
        for (int64_t t = 0; t < L; ++t) {
          const int64_t block = btp[b * MB + t / BS];
          const float* kr = kp + ((hk * NB + block) * BS + t % BS) * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qb + g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < D; ++i) s += qg[i] * kr[i];
            scores[g * L + t] = s * fscale;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* sg = scores.data() + g * L;
          float m = -INFINITY;
          for (int64_t t = 0; t < L; ++t) m = sg[t] > m ? sg[t] : m;
          float sum = 0.f;
          for (int64_t t = 0; t < L; ++t) {
            sg[t] = std::exp(sg[t] - m);
            sum += sg[t];
          }
          const float inv = 1.f / sum;
          for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
        }
        float* ob = op + (b * H + hk * G) * D;
        for (int64_t t = 0; t < L; ++t) {
          const int64_t block = btp[b * MB + t / BS];
          const float* vr = vp + ((hk * NB + block) * BS + t % BS) * D;
          for (int64_t g = 0; g < G; ++g) {
            const float w = scores[g * L + t];
            float* og = ob + g * D;
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) og[i] += w * vr[i];
          }
        }
      }
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
}
