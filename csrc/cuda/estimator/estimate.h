// The fused vertical-slash estimator's Python functions (csrc/cuda/estimate_binding.cpp), added to
// the CUDA op module by binding.cpp's PYBIND11_MODULE.
#pragma once

#include <pybind11/pybind11.h>

namespace mtraining {

// Defines estimate_row_stats, estimate_masses, estimate_select, estimate_select_pair and
// estimate_finalize on `m`.
void register_estimator(pybind11::module_& m);

}  // namespace mtraining
