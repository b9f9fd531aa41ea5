// Python bindings of the `eaglespec_ops` extension: the target's per-token CPU operations in bf16,
// each row-invariant (a row's result never depends on the other rows of the call).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "row-invariant decode attention over a bf16 KV cache",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"), py::arg("amx") = false);
  m.def("attention_amx_ready", &eaglespec::attention_amx_ready,
        "whether decode_attention can take amx=True (built with AMX-BF16, tile state granted)");
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows, normalised in fp32");
  m.def("rope", &rope, "rotary embedding (rotate-half layout) of bf16 heads");
  m.def("qkv_rope_write", &qkv_rope_write, "split qkv, rotate q and k, write k and v into the cache at slots; returns q",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::arg("nh"), py::arg("nkv"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up of bf16 rows [..., 2I] -> [..., I], the reference's roundings");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (bf16 or fp32 rows; NaNs never win)");
  m.def("topk_logprobs", &topk_logprobs, "the k largest log-probabilities of each row of logits, and their indices",
        py::arg("x"), py::arg("k"));
  m.def("verify_greedy_rows", &verify_greedy_rows,
        "greedy verification of B draft trees: (path, count, emitted, bonus) as spec.verify.verify_greedy",
        py::arg("logits"), py::arg("tokens"), py::arg("parents"), py::arg("valid"), py::arg("width"));
  m.def("keep_rows", &keep_rows, "move each row's accepted KV slots start + src[j] to start + j (in place)",
        py::arg("k"), py::arg("v"), py::arg("start"), py::arg("src"));
  m.def("softmax_rows", &softmax_rows, "softmax(logits / temperature) per row, fp32 (temperature-only sampling)",
        py::arg("x"), py::arg("temperature"));
  m.def("draw_rows", &draw_rows, "inverse-CDF draws: spec.rng.draw", py::arg("probs"), py::arg("u"));
  m.def("uniforms_rows", &uniforms_rows, "counter-based uniforms: spec.rng.uniforms", py::arg("seed"), py::arg("step"),
        py::arg("node"), py::arg("purpose"));
  bind_layer_stack(m);
  bind_draft_runner(m);
  m.def("verify_sampling_rows", &verify_sampling_rows,
        "speculative sampling over B draft trees of temperature-only rows: (path, count, emitted, bonus)",
        py::arg("logits"), py::arg("tokens"), py::arg("parents"), py::arg("valid"), py::arg("temperature"),
        py::arg("draft_probs"), py::arg("u_accept"), py::arg("u_bonus"), py::arg("width"), py::arg("k_max"));
}
