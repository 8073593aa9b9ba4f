// The Python module of inferd's CPU kernels (inferd/model/kernels.py builds it from every .cpp file here).
#include <torch/extension.h>

#include "ops.h"

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_idx, const at::Tensor& context_lens,
                           int64_t num_decode, double scale);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w_packed, int64_t n, const c10::optional<at::Tensor>& bias,
                        bool out_fp32, const c10::optional<at::Tensor>& into);
at::Tensor panel_linear_argmax(const at::Tensor& x, const at::Tensor& w_packed, int64_t n,
                               const c10::optional<at::Tensor>& bias);
at::Tensor panel_linear_silu(const at::Tensor& x, const at::Tensor& w_packed, int64_t inter);
at::Tensor pack_panels(const at::Tensor& w, const c10::optional<at::Tensor>& out, c10::optional<bool> pairs);
at::Tensor add_rms_norm(at::Tensor& h, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& logits);
at::Tensor nucleus_floor(const at::Tensor& probs, const at::Tensor& top_p);
at::Tensor sample_probs(const at::Tensor& probs, const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& u);
at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                          at::Tensor& v_cache, const at::Tensor& slots, int64_t num_heads, int64_t num_kv);

// Each kernel releases the GIL while it runs (as torch's own operators do), so the server's event loop thread can
// stream the previous step's tokens meanwhile instead of waiting for the engine thread's next bytecode boundary.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention", &paged_attention, "causal attention of decode and prefill rows over a paged KV cache",
        nogil());
  m.def("panel_linear", &panel_linear,
        "x @ W.T (+ b), BF16 or FP32 weights packed in 16-column panels, FP32 accumulation; with `into` (FP32 [M, n]), "
        "into += x @ W.T (+ b) in place and returned",
        py::arg("x"), py::arg("w_packed"), py::arg("n"), py::arg("bias"), py::arg("out_fp32"),
        py::arg("into") = py::none(), nogil());
  m.def("panel_linear_argmax", &panel_linear_argmax,
        "each row's argmax of x @ W.T (+ b) in FP32, as argmax_rows(panel_linear(..., out_fp32=True)) gives it; on "
        "AMX without writing the [M, n] output",
        py::arg("x"), py::arg("w_packed"), py::arg("n"), py::arg("bias") = py::none(), nogil());
  m.def("panel_linear_silu", &panel_linear_silu,
        "SiLU(gate) * up of x @ gate_up.T (gate_up packed in panels): one pass on AMX, else panel_linear + silu_mul",
        nogil());
  m.def("pack_panels", &pack_panels, "a [N, K] BF16 or FP32 weight in panel_linear's panel layout", py::arg("w"),
        py::arg("out") = py::none(), py::arg("pairs") = py::none(), nogil());
  m.def("add_rms_norm", &add_rms_norm, "h += delta in place, then RMSNorm(h) * weight", nogil());
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of a fused [T, 2 I] gate_up", nogil());
  m.def("argmax_rows", &argmax_rows, "each row's argmax of [S, V] FP32 logits, as torch.argmax(dim=-1)", nogil());
  m.def("nucleus_floor", &nucleus_floor, "each row's top-p floor: the probability of its nucleus' least likely token",
        nogil());
  m.def("sample_probs", &sample_probs, "one token per row of probabilities after top-p and min-p, by inverse transform",
        nogil());
  m.def("rope_and_cache", &rope_and_cache, "rotary embedding of Q and K, K and V written to the paged cache",
        nogil());
  m.attr("bf16_pairs") = inferd::kBf16Pairs;  // BF16 panels of an even K in pairs of k (AVX512-BF16 build)
  m.attr("amx") = inferd::amx_pairs();  // pair panels multiplied on AMX tiles in this process
  py::class_<inferd::DecodeStack>(m, "DecodeStack",
                                  "every decoder layer of a decode step in one call (inferd's BF16 GEMM path)")
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const at::Tensor&, int64_t,
                    int64_t, int64_t, double, double>(),
           py::arg("weights"), py::arg("qkv_bias"), py::arg("final_norm"), py::arg("num_heads"), py::arg("num_kv"),
           py::arg("head_dim"), py::arg("eps"), py::arg("scale"))
      .def("run", &inferd::DecodeStack::run, "final hidden states of a step", py::arg("h"), py::arg("cos"),
           py::arg("sin"), py::arg("k_caches"), py::arg("v_caches"), py::arg("slots"), py::arg("block_tables"),
           py::arg("seq_idx"), py::arg("context_lens"), py::arg("num_decode"), nogil());
}
