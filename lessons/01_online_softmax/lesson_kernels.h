// lessons/01_online_softmax/lesson_kernels.h — the lesson's CUDA kernels (online_softmax.h) for
// one device: the emulator's build for --device sim, nvcc's for --device cuda.
#pragma once
#include "common/core/check.h"
#include "kernels/device.h"
#include "lessons/01_online_softmax/online_softmax.h"

namespace ff::online_softmax {

struct LessonKernels {
  decltype(&sim::row_states) row_states;
  decltype(&sim::normalise) normalise;
  decltype(&sim::decode_partial) decode_partial;
  decltype(&sim::merge_states) merge_states;
};

inline LessonKernels lesson_kernels(Device d) {
#if FF_HAVE_CUDA
  if (d == Device::cuda)
    return {cuda::row_states, cuda::normalise, cuda::decode_partial, cuda::merge_states};
#endif
  FF_CHECK(d == Device::sim, "no lesson kernels for device " << device_name(d));
  return {sim::row_states, sim::normalise, sim::decode_partial, sim::merge_states};
}

}  // namespace ff::online_softmax
