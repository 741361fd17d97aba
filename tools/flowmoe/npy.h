// Minimal NumPy .npy file I/O for the command-line tool (its only user).
//
// Reads format versions 1.0 and 2.0, writes 1.0 (2.0 only if the header would not fit).
// Little-endian, C order only. Supported dtypes (as written in the header's 'descr'):
//   '<f4' float32   '<u2' uint16 (bfloat16 bits)   '|u1' uint8   '<i4' int32
// Every failure (missing file, bad magic, unsupported dtype or order, truncated data) throws
// flowmoe::Error naming the file and what was expected.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "flowmoe/error.h"

namespace flowmoe {

constexpr const char* kNpyF32 = "<f4";
constexpr const char* kNpyU16 = "<u2";
constexpr const char* kNpyU8 = "|u1";
constexpr const char* kNpyI32 = "<i4";

struct NpyArray {
  std::string dtype;           // normalised descr: one of the kNpy* strings above
  std::vector<int64_t> shape;  // C order; empty for a 0-d array
  std::vector<uint8_t> data;   // numel() * itemsize bytes, little-endian elements

  int64_t numel() const;
};

// Bytes per element of a supported dtype; throws for anything else.
size_t npy_itemsize(const std::string& dtype);
// Readable dtype name: "float32", "uint16 (bfloat16 bits)", "uint8", "int32".
std::string npy_dtype_name(const std::string& dtype);
// "[3, 4]"
std::string npy_shape_str(const std::vector<int64_t>& shape);

// Reads a whole .npy file. Anything but a regular file (a FIFO, socket, device or directory) is
// refused with what it is, checked on the opened descriptor (opened without blocking), so neither
// a FIFO without a writer nor a path swapped for one after a check can hang the call.
NpyArray npy_load(const std::string& path);
// Writes a whole .npy file to the open descriptor `fd` (an exclusively created temporary, see
// set_files.h; never a path, which could be a planted link); `path` names the file in errors. The
// caller closes fd. `data` holds prod(shape) elements of `dtype`, C order.
void npy_write(int fd, const std::string& path, const std::string& dtype, const std::vector<int64_t>& shape,
               const void* data);

// Copies the elements of `a` out as T, checking that the dtype is `dtype` (path is for messages).
template <typename T>
std::vector<T> npy_values(const NpyArray& a, const std::string& dtype, const std::string& path) {
  FLOWMOE_CHECK(a.dtype == dtype, path << ": expected dtype " << npy_dtype_name(dtype) << " ('"
                                       << dtype << "'), got " << npy_dtype_name(a.dtype) << " ('"
                                       << a.dtype << "')");
  FLOWMOE_CHECK(sizeof(T) == npy_itemsize(dtype), "npy_values: element type size mismatch");
  std::vector<T> out(static_cast<size_t>(a.numel()));
  if (!out.empty()) std::memcpy(out.data(), a.data.data(), out.size() * sizeof(T));
  return out;
}

}  // namespace flowmoe
