// Feature `tch`: what the `tch` crate's C interface lacks. The vector-Jacobian product of a
// recorded graph with a given output gradient (`copus_vjp`), a count of LibTorch's operator
// calls (`aten::` functions, nested calls included, the same events PyTorch's profiler records)
// by a global RecordFunction callback, from the first call of `copus_operator_count_start` on,
// over every thread of the process, and AdamW over many parameters in `_foreach_` operations
// (`copus_adamw_foreach`), which tch does not expose.

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
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

// Writes `what` to `err` (at most `err_len` bytes, NUL-terminated) and returns 1.
int failed(const char* what, char* err, size_t err_len) {
  if (err_len > 0) {
    std::strncpy(err, what, err_len - 1);
    err[err_len - 1] = '\0';
  }
  return 1;
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
    return failed(e.what(), err, err_len);
  } catch (...) {
    return failed("an exception that is not a std::exception", err, err_len);
  }
}

// One AdamW update of `n` parameters in Burn 0.22's arithmetic, operation for operation and in
// its order (copus-burn optim/adamw.rs `device_update`), each operation one `_foreach_` call
// over all `n` tensors: on CUDA a few multi-tensor kernels where the per-parameter form
// launches about ten per parameter; on the CPU the same per-tensor kernels, so the values are
// the per-parameter form's to the bit. A division by a scalar is, on CUDA, a multiplication by
// the scalar's f32 reciprocal, as ATen's CUDA division by a host scalar computes it (the
// per-parameter form's path); elsewhere a division. Intermediates this function makes are
// updated in place and released once used, so at most about four lists of the group's size
// exist at once besides the inputs. `p`, `g` (and `m1`, `m2` unless `first`) are n flat f32
// tensors each; `k` holds beta_1, 1 - beta_1, beta_2, 1 - beta_2, the two bias corrections,
// epsilon, the decay's `1 - lr * weight_decay` (used when `decay`) and the learning rate, each an
// f32 widened to double as Burn's scalars are. Writes n fresh handles each to `out_p`,
// `out_m1`, `out_m2`. Returns 0, or 1 with the error's text in `err` (nothing written then).
extern "C" int copus_adamw_foreach(void** p, void** g, void** m1, void** m2, int n, const double* k, int first, int decay,
                                   void** out_p, void** out_m1, void** out_m2, char* err, size_t err_len) {
  try {
    c10::NoGradGuard no_grad;
    auto list = [n](void** handles) {
      std::vector<at::Tensor> v;
      v.reserve(n);
      for (int i = 0; i < n; ++i) v.push_back(*static_cast<at::Tensor*>(handles[i]));
      return v;
    };
    const double beta_1 = k[0], factor_1 = k[1], beta_2 = k[2], factor_2 = k[3], correct_1 = k[4], correct_2 = k[5],
                 eps = k[6], keep = k[7], lr = k[8];
    auto params = list(p), grads = list(g);
    const bool reciprocal = n > 0 && params[0].is_cuda();
    auto divided = [reciprocal](const std::vector<at::Tensor>& xs, double c) {
      return reciprocal ? at::_foreach_mul(xs, static_cast<double>(1.0f / static_cast<float>(c))) : at::_foreach_div(xs, c);
    };
    std::vector<at::Tensor> new_1 = at::_foreach_mul(grads, factor_1);
    std::vector<at::Tensor> new_2 = at::_foreach_mul(grads, grads);
    at::_foreach_mul_(new_2, factor_2);
    if (!first) {
      // (m * beta) + step: the sum is the same whichever side holds it.
      auto step_1 = std::move(new_1), step_2 = std::move(new_2);
      new_1 = at::_foreach_mul(list(m1), beta_1);
      at::_foreach_add_(new_1, step_1);
      step_1.clear();
      new_2 = at::_foreach_mul(list(m2), beta_2);
      at::_foreach_add_(new_2, step_2);
    }
    auto denom = divided(new_2, correct_2);
    at::_foreach_sqrt_(denom);
    at::_foreach_add_(denom, eps);
    auto delta = divided(new_1, correct_1);
    at::_foreach_div_(delta, denom);
    denom.clear();
    at::_foreach_mul_(delta, lr);
    std::vector<at::Tensor> updated;
    if (decay) {
      updated = at::_foreach_mul(params, keep);
      at::_foreach_sub_(updated, delta);
    } else {
      updated = at::_foreach_sub(params, delta);
    }
    for (int i = 0; i < n; ++i) {
      out_p[i] = new at::Tensor(updated[i]);
      out_m1[i] = new at::Tensor(new_1[i]);
      out_m2[i] = new at::Tensor(new_2[i]);
    }
    return 0;
  } catch (const std::exception& e) {
    return failed(e.what(), err, err_len);
  } catch (...) {
    return failed("an exception that is not a std::exception", err, err_len);
  }
}
