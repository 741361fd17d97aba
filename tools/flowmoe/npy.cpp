// NumPy .npy reader/writer (see npy.h). The header is a Python dict literal such as
//   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
// which is parsed by a small recursive-descent parser that accepts exactly the value kinds
// NumPy writes there: quoted strings, True/False and tuples of integers.
#include "npy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <limits>
#include <sstream>

namespace flowmoe {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

bool host_is_little_endian() {
  const uint16_t one = 1;
  uint8_t first;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

// Maps the descr spellings NumPy may write for our dtypes to the normalised form.
bool normalise_descr(const std::string& d, std::string* out) {
  if (d == "<f4") *out = kNpyF32;
  else if (d == "<u2") *out = kNpyU16;
  else if (d == "|u1" || d == "<u1" || d == "=u1") *out = kNpyU8;
  else if (d == "<i4") *out = kNpyI32;
  else return false;
  return true;
}

// Text from a file made safe for an error message: non-printable bytes become \xNN, and text
// longer than kPrintMax bytes is cut (a header may be up to 4 GiB long).
constexpr size_t kPrintMax = 120;
std::string printable(const std::string& s) {
  static const char hex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s.substr(0, kPrintMax)) {
    if (std::isprint(c)) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (s.size() > kPrintMax) out += "... (" + std::to_string(s.size()) + " bytes in all)";
  return out;
}

struct Header {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
  bool has_descr = false, has_order = false, has_shape = false;
};

// Parser of the header dict. Errors name the file and the offending position.
class HeaderParser {
 public:
  HeaderParser(const std::string& text, const std::string& path) : s_(text), path_(path) {}

  Header parse() {
    Header h;
    expect('{');
    for (;;) {
      skip_ws();
      if (peek() == '}') break;
      const std::string key = parse_string();
      expect(':');
      skip_ws();
      if (key == "descr") {
        FLOWMOE_CHECK(peek() == '\'' || peek() == '"',
                      path_ << ": unsupported dtype: 'descr' is not a simple type string (structured "
                               "dtypes are not supported; expected one of '<f4', '<u2', '|u1', '<i4')");
        h.descr = parse_string();
        h.has_descr = true;
      } else if (key == "fortran_order") {
        h.fortran_order = parse_bool();
        h.has_order = true;
      } else if (key == "shape") {
        h.shape = parse_tuple();
        h.has_shape = true;
      } else {
        fail("unexpected key '" + printable(key) + "' (expected 'descr', 'fortran_order', 'shape')");
      }
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      skip_ws();
      FLOWMOE_CHECK(peek() == '}', path_ << ": malformed .npy header: expected ',' or '}' at offset "
                                         << pos_ << " in " << quoted());
      break;
    }
    expect('}');
    // NumPy evaluates the whole header as one Python literal: only whitespace may follow the '}'.
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected bytes after the closing '}'");
    FLOWMOE_CHECK(h.has_descr && h.has_order && h.has_shape,
                  path_ << ": malformed .npy header: expected keys 'descr', 'fortran_order' and "
                           "'shape' in "
                        << quoted());
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    std::ostringstream os;
    os << path_ << ": malformed .npy header: " << what << " at offset " << pos_ << " in " << quoted();
    throw Error(__FILE__, __LINE__, os.str());
  }
  std::string quoted() const { return "\"" + printable(s_) + "\""; }
  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void skip_ws() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  void expect(char c) {
    skip_ws();
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  std::string parse_string() {
    skip_ws();
    const char q = peek();
    if (q != '\'' && q != '"') fail("expected a quoted string");
    const size_t end = s_.find(q, pos_ + 1);
    if (end == std::string::npos) fail("unterminated string");
    std::string out = s_.substr(pos_ + 1, end - pos_ - 1);
    pos_ = end + 1;
    return out;
  }
  bool parse_bool() {
    skip_ws();
    if (s_.compare(pos_, 4, "True") == 0) {
      pos_ += 4;
      return true;
    }
    if (s_.compare(pos_, 5, "False") == 0) {
      pos_ += 5;
      return false;
    }
    fail("expected True or False");
  }
  int64_t parse_int() {
    skip_ws();
    if (!std::isdigit(static_cast<unsigned char>(peek()))) fail("expected a non-negative integer");
    int64_t v = 0;
    while (std::isdigit(static_cast<unsigned char>(peek()))) {
      const int d = peek() - '0';
      if (v > (std::numeric_limits<int64_t>::max() - d) / 10) fail("dimension too large");
      v = v * 10 + d;
      ++pos_;
    }
    if (peek() == 'L') ++pos_;  // Python 2 long suffix
    return v;
  }
  std::vector<int64_t> parse_tuple() {
    std::vector<int64_t> dims;
    expect('(');
    for (;;) {
      skip_ws();
      if (peek() == ')') break;
      dims.push_back(parse_int());
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() != ')') fail("expected ',' or ')' in shape");
    }
    expect(')');
    return dims;
  }

  const std::string& s_;
  const std::string& path_;
  size_t pos_ = 0;
};

int64_t numel_of(const std::vector<int64_t>& shape, const std::string& path) {
  int64_t n = 1;
  for (int64_t d : shape) {
    FLOWMOE_CHECK(d >= 0, path << ": negative dimension in shape " << npy_shape_str(shape));
    FLOWMOE_CHECK(d == 0 || n <= std::numeric_limits<int64_t>::max() / d,
                  path << ": shape " << npy_shape_str(shape) << " has too many elements");
    n *= d;
  }
  return n;
}

}  // namespace

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t npy_itemsize(const std::string& dtype) {
  if (dtype == kNpyF32 || dtype == kNpyI32) return 4;
  if (dtype == kNpyU16) return 2;
  if (dtype == kNpyU8) return 1;
  FLOWMOE_CHECK(false, "unsupported .npy dtype '" << dtype
                                                  << "' (expected one of '<f4', '<u2', '|u1', '<i4')");
  return 0;
}

std::string npy_dtype_name(const std::string& dtype) {
  if (dtype == kNpyF32) return "float32";
  if (dtype == kNpyU16) return "uint16 (bfloat16 bits)";
  if (dtype == kNpyU8) return "uint8";
  if (dtype == kNpyI32) return "int32";
  return "'" + dtype + "'";
}

namespace {
// An input opened as a regular file or refused: opened without blocking (a FIFO without a writer
// would block open() forever, one with a writer would be read as a stream of unknown size), then
// checked on the open descriptor (fstat), so the path cannot be swapped for a FIFO in between.
class InputFile {
 public:
  explicit InputFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    FLOWMOE_CHECK(fd_ >= 0, path << ": cannot open for reading (" << std::strerror(errno)
                                 << "; expected an existing .npy file)");
    struct stat st;
    const bool ok = fstat(fd_, &st) == 0;
    if (!ok || !S_ISREG(st.st_mode)) {
      const char* what = !ok                       ? "not a file flowmoe can inspect"
                         : S_ISDIR(st.st_mode)    ? "a directory"
                         : S_ISFIFO(st.st_mode)   ? "a FIFO (named pipe)"
                         : S_ISSOCK(st.st_mode)   ? "a socket"
                         : S_ISCHR(st.st_mode)    ? "a character device"
                         : S_ISBLK(st.st_mode)    ? "a block device"
                                                  : "not a regular file";
      ::close(fd_);
      FLOWMOE_CHECK(false, path << ": is " << what << "; expected a regular .npy file (flowmoe reads inputs "
                                << "whole, with their size known, so pipes and devices are refused)");
    }
    size_ = static_cast<int64_t>(st.st_size);
    fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
  }
  ~InputFile() { ::close(fd_); }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  int64_t size() const { return size_; }
  // Reads up to n bytes; returns how many were read (fewer only at the end of the file).
  int64_t read(void* out, int64_t n) {
    int64_t got = 0;
    while (got < n) {
      const ssize_t r = ::read(fd_, static_cast<char*>(out) + got, static_cast<size_t>(n - got));
      if (r < 0 && errno == EINTR) continue;
      FLOWMOE_CHECK(r >= 0, path_ << ": read error (" << std::strerror(errno) << ")");
      if (r == 0) break;
      got += r;
    }
    return got;
  }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};
}  // namespace


std::string npy_shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

NpyArray npy_load(const std::string& path) {
  FLOWMOE_CHECK(host_is_little_endian(), "npy_load: only little-endian hosts are supported");
  InputFile f(path);
  const int64_t file_size = f.size();

  // Preamble: magic, version, header length.
  char pre[12] = {};
  FLOWMOE_CHECK(f.read(pre, 10) == 10 && std::memcmp(pre, kMagic, kMagicLen) == 0,
                path << ": not a .npy file (expected the magic string \\x93NUMPY at the start)");
  const int major = static_cast<uint8_t>(pre[6]), minor = static_cast<uint8_t>(pre[7]);
  FLOWMOE_CHECK((major == 1 || major == 2) && minor == 0,
                path << ": unsupported .npy format version " << major << "." << minor
                     << " (expected 1.0 or 2.0)");
  uint32_t header_len = 0;
  int64_t preamble = 10;
  if (major == 1) {
    header_len = static_cast<uint8_t>(pre[8]) | (static_cast<uint32_t>(static_cast<uint8_t>(pre[9])) << 8);
  } else {
    FLOWMOE_CHECK(f.read(pre + 10, 2) == 2, path << ": truncated .npy preamble (expected 12 bytes for version 2.0)");
    for (int i = 0; i < 4; ++i) header_len |= static_cast<uint32_t>(static_cast<uint8_t>(pre[8 + i])) << (8 * i);
    preamble = 12;
  }
  FLOWMOE_CHECK(preamble + static_cast<int64_t>(header_len) <= file_size,
                path << ": truncated .npy header (header length " << header_len << " but the file has "
                     << file_size << " bytes)");
  std::string header(header_len, '\0');
  FLOWMOE_CHECK(f.read(&header[0], header_len) == int64_t(header_len), path << ": truncated .npy header");
  while (!header.empty() && (header.back() == '\n' || header.back() == ' ')) header.pop_back();

  const Header h = HeaderParser(header, path).parse();
  NpyArray a;
  FLOWMOE_CHECK(!(h.descr.size() > 0 && h.descr[0] == '>'),
                path << ": big-endian dtype '" << printable(h.descr) << "' is not supported (expected little-endian)");
  FLOWMOE_CHECK(normalise_descr(h.descr, &a.dtype),
                path << ": unsupported dtype '" << printable(h.descr)
                     << "' (expected '<f4' float32, '<u2' uint16/bfloat16 bits, '|u1' uint8 or '<i4' int32"
                     << (h.descr == "<f8" || h.descr == "<f2"
                             ? "; convert it first, e.g. np.save(path, np.load(path).astype(np.float32))"
                             : "")
                     << ")");
  FLOWMOE_CHECK(!h.fortran_order, path << ": fortran_order is True; only C-order arrays are supported "
                                          "(save with np.ascontiguousarray)");
  a.shape = h.shape;

  const int64_t n = numel_of(a.shape, path);
  const int64_t item = static_cast<int64_t>(npy_itemsize(a.dtype));
  FLOWMOE_CHECK(n <= std::numeric_limits<int64_t>::max() / item, path << ": array too large");
  const int64_t want = n * item;
  const int64_t have = file_size - preamble - static_cast<int64_t>(header_len);
  FLOWMOE_CHECK(have >= want, path << ": truncated data: shape " << npy_shape_str(a.shape) << " of "
                                   << npy_dtype_name(a.dtype) << " needs " << want << " bytes, the file has "
                                   << have);
  FLOWMOE_CHECK(have == want, path << ": " << (have - want) << " unexpected bytes after the data of shape "
                                   << npy_shape_str(a.shape) << " (" << want << " bytes expected)");
  a.data.resize(static_cast<size_t>(want));
  if (want > 0) {
    const int64_t got = f.read(a.data.data(), want);
    FLOWMOE_CHECK(got == want, path << ": read error: got " << got << " of " << want << " data bytes");
  }
  return a;
}

void npy_write(int fd, const std::string& path, const std::string& dtype, const std::vector<int64_t>& shape,
               const void* data) {
  FLOWMOE_CHECK(host_is_little_endian(), "npy_write: only little-endian hosts are supported");
  const size_t item = npy_itemsize(dtype);
  const int64_t n = numel_of(shape, path);

  std::string dict = "{'descr': '" + dtype + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) dict += std::to_string(shape[i]) + ", ";
  if (shape.size() > 1) dict.resize(dict.size() - 2);  // "(3, 4)"; a 1-d shape keeps "(3,"
  else if (shape.size() == 1) dict.pop_back();
  dict += "), }";

  // Pad with spaces so that the data starts at a multiple of 64 bytes; the header ends in '\n'.
  const bool v2 = 10 + dict.size() + 1 + 64 > 0xFFFF;
  const size_t preamble = v2 ? 12 : 10;
  size_t total = preamble + dict.size() + 1;
  total = (total + 63) / 64 * 64;
  const size_t header_len = total - preamble;
  dict.append(header_len - dict.size() - 1, ' ');
  dict += '\n';

  std::string head(kMagic, kMagicLen);
  head += static_cast<char>(v2 ? 2 : 1);
  head += '\0';
  for (size_t i = 0; i < (v2 ? 4u : 2u); ++i) head += static_cast<char>((header_len >> (8 * i)) & 0xFF);
  head += dict;
  if (n > 0) FLOWMOE_CHECK(data != nullptr, path << ": npy_write given no data for shape " << npy_shape_str(shape));
  // write(2) on the descriptor, in pieces of at most 1 GiB, until every byte is written.
  const auto write_all = [&](const char* p, size_t len) {
    while (len > 0) {
      const ssize_t w = ::write(fd, p, len < (size_t(1) << 30) ? len : (size_t(1) << 30));
      if (w < 0 && errno == EINTR) continue;
      const int err = w < 0 ? errno : ENOSPC;  // (0 bytes written: no room)
      FLOWMOE_CHECK(w > 0, path << ": write failed (" << std::strerror(err)
                                << (err == ENOSPC  ? "; the disk is full"
                                    : err == EDQUOT ? "; the disk quota is used up"
                                    : err == EFBIG  ? "; the file size limit (ulimit -f) or the file system's largest "
                                                      "file size was reached"
                                                    : "")
                                << ")");
      p += w;
      len -= static_cast<size_t>(w);
    }
  };
  write_all(head.data(), head.size());
  if (n > 0) write_all(static_cast<const char*>(data), static_cast<size_t>(n) * item);
}

}  // namespace flowmoe
