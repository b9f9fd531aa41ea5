// A run of decoder layers as one call: direct.py's per-layer path (RMSNorm, the q/k/v product, the
// fused split + RoPE + cache write, decode attention, the output product and residual, RMSNorm,
// gate/up, silu_mul, down and residual), looped here over layers instead of in Python.
//
// Why: with every layer planned, a SmolLM2 decode still spent ~2 ms of a ~14 ms forward (2-core
// EPYC) in Python between the kernels: thirty layers of ten calls, their argument checks and the
// views around them. Here the same kernels get the same inputs in the same order, so the bits are
// direct.py's (tests/test_direct.py compares logits and caches).
//
// The products live in the int4 / int8 extension modules; they are called through the addresses
// those modules export (`int4_gemm_address`, `int8_gemm_address`).

#include "layer_stack.h"

void bind_layer_stack(py::module_& m) {
  py::class_<LayerStack>(m, "LayerStack", "decoder layers run as one call (csrc/layer_stack.cpp)")
      .def(py::init<>())
      .def("add", &LayerStack::add, py::arg("attn_norm"), py::arg("mlp_norm"), py::arg("eps"), py::arg("qkv_fn"),
           py::arg("qkv_a"), py::arg("qkv_b"), py::arg("out_fn"), py::arg("out_a"), py::arg("out_b"),
           py::arg("gate_up_fn"), py::arg("gate_up_a"), py::arg("gate_up_b"), py::arg("down_fn"),
           py::arg("down_a"), py::arg("down_b"), py::arg("nh"), py::arg("nkv"))
      .def("__len__", &LayerStack::size)
      // A forward's worth of kernels without the GIL: other Python threads (the server's event
      // loop) run meanwhile, as they could between the per-layer path's calls. Only C++ and the
      // caller's tensors are touched inside.
      .def("run", &LayerStack::run, py::arg("x"), py::arg("b"), py::arg("t"), py::arg("cos"), py::arg("sin"),
           py::arg("k"), py::arg("v"), py::arg("slots"), py::arg("view"), py::arg("mask"), py::arg("scale"),
           py::arg("amx"), py::arg("first"), py::arg("last"), py::call_guard<py::gil_scoped_release>());
}
