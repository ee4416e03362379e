// common/core/npy.h — numpy's .npy file format, for --dump, the golden data and the checkpoints.
//
// Design rules:
//  * One format, read and written as numpy does: the magic "\x93NUMPY", the version, the header
//    length (little-endian: uint16 in version 1.0, uint32 in 2.0 and 3.0), then a Python dict
//    literal such as
//      {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
//    padded with spaces and ending in '\n', then the raw elements in C (row-major) order.
//    The writer writes version 1.0 with the data at a multiple of 64 bytes, as np.save does; the
//    reader reads versions 1.0, 2.0 and 3.0 with a header of any length (numpy pads to 64 bytes,
//    other writers to more): the data start where the file's own header ends (NpyInfo::data_offset).
//    Spec: https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html
//  * Three dtypes only: '<f4' (float32), '<i4' (int32) and '<i8' (int64), little-endian,
//    C order. Anything else is refused with one ff::Error line that starts with the path
//    and says what is supported, never guessed at.
//  * The reader trusts nothing: every size is checked against the file's length before
//    anything is allocated, and bytes left over after the data are an error too.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/core/tensor.h"

namespace ff {

// ---- tensors

// float32 tensors as '<f4', int64 index tensors as '<i8'. Tensors on sim/cuda are copied
// to the host first. The directory must exist; an existing file is overwritten.
void save_npy(const std::string& path, const Tensor& t);

// '<f4' gives a float32 tensor; '<i4' and '<i8' give an int64 index tensor ('<i4' is
// widened). The tensor is on the cpu device.
Tensor load_npy(const std::string& path);

// ---- raw arrays (any of the three dtypes, e.g. to save int32)

struct NpyArray {
  std::string descr;           // "<f4", "<i4" or "<i8"
  std::vector<int64_t> shape;  // () for a 0-d array (one element)
  std::vector<char> data;      // the elements, C order, little-endian
};

// Bytes per element of a supported descr; throws ff::Error for any other.
size_t npy_itemsize(const std::string& descr);

NpyArray read_npy(const std::string& path);
// The header only, checked as read_npy checks it (the data must be exactly what the shape says):
// where the data start, for a reader or writer of parts of them (lesson 08's checkpoints).
struct NpyInfo {
  std::string descr;
  std::vector<int64_t> shape;
  uint64_t data_offset = 0, data_bytes = 0;
};
NpyInfo read_npy_info(const std::string& path);
// The header write_npy writes for (descr, shape), the data starting right after it.
std::string npy_header(const std::string& descr, const std::vector<int64_t>& shape);
// data must hold exactly numel(shape) * itemsize(descr) bytes.
void write_npy(const std::string& path, const std::string& descr,
               const std::vector<int64_t>& shape, const std::vector<char>& data);

}  // namespace ff
