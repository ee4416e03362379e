// lessons/01_online_softmax/lesson_kernels.h — the lesson's CUDA kernels (online_softmax.h) for
// one device: the emulator's build for --device sim, nvcc's for --device cuda.
#pragma once
#include "common/core/check.h"
#include "kernels/device.h"
#include "lessons/01_online_softmax/online_softmax.h"

struct LessonKernels {
  decltype(&lesson01::sim::row_states) row_states;
  decltype(&lesson01::sim::normalise) normalise;
  decltype(&lesson01::sim::decode_partial) decode_partial;
  decltype(&lesson01::sim::merge_states) merge_states;
};

inline LessonKernels lesson_kernels(ff::Device d) {
#if FF_HAVE_CUDA
  if (d == ff::Device::cuda)
    return {lesson01::cuda::row_states, lesson01::cuda::normalise, lesson01::cuda::decode_partial,
            lesson01::cuda::merge_states};
#endif
  FF_CHECK(d == ff::Device::sim, "no lesson kernels for device " << ff::device_name(d));
  return {lesson01::sim::row_states, lesson01::sim::normalise, lesson01::sim::decode_partial,
          lesson01::sim::merge_states};
}
