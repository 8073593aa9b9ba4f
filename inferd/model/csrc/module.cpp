// The Python module of inferd's CPU kernels (inferd/model/kernels.py builds it from every .cpp file here).
#include <torch/extension.h>

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w_packed, int64_t n, const c10::optional<at::Tensor>& bias,
                       bool out_fp32);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
  m.def("bf16_linear", &bf16_linear, "x @ W.T (+ b), BF16 weights packed in 16-column panels, FP32 accumulation");
}
