// Feature `tch`: what the `tch` crate's C interface lacks. The vector-Jacobian product of a
// recorded graph with a given output gradient (`copus_vjp`), and a count of LibTorch's operator
// calls (`aten::` functions, nested calls included, the same events PyTorch's profiler records)
// by a global RecordFunction callback, from the first call of `copus_operator_count_start` on,
// over every thread of the process.

#include <ATen/record_function.h>
#include <torch/csrc/autograd/autograd.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace {
std::atomic<uint64_t> calls{0};
std::atomic<bool> started{false};

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  if (std::strncmp(fn.name(), "aten::", 6) == 0) {
    calls.fetch_add(1, std::memory_order_relaxed);
  }
  return nullptr;
}
}  // namespace

extern "C" void copus_operator_count_start() {
  if (!started.exchange(true)) {
    at::addGlobalCallback(at::RecordFunctionCallback(on_enter).scopes({at::RecordScope::FUNCTION}));
  }
}

extern "C" uint64_t copus_operator_count() { return calls.load(std::memory_order_relaxed); }

// The vector-Jacobian product of a recorded LibTorch graph: the gradients of `inputs` (n
// tensors) given the gradient `grad` of `out`, each a new tensor written to `results` (an
// undefined tensor for an input the graph does not reach), the graph released. Tensors are
// tch's handles (`at::Tensor*`, freed by tch). Returns 0, or 1 with the error's text in `err`.
extern "C" int copus_vjp(void* out, void* grad, void** inputs, int n, void** results, char* err, size_t err_len) {
  try {
    std::vector<at::Tensor> ins;
    ins.reserve(n);
    for (int i = 0; i < n; ++i) ins.push_back(*static_cast<at::Tensor*>(inputs[i]));
    auto gs = torch::autograd::grad({*static_cast<at::Tensor*>(out)}, ins, {*static_cast<at::Tensor*>(grad)},
                                    /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
    for (int i = 0; i < n; ++i) results[i] = new at::Tensor(gs[i]);
    return 0;
  } catch (const std::exception& e) {
    if (err_len > 0) {
      std::strncpy(err, e.what(), err_len - 1);
      err[err_len - 1] = '\0';
    }
    return 1;
  }
}
