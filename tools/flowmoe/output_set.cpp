// All-or-nothing output of a set of .npy files (see output_set.h).
#include "output_set.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>

#include "flowmoe/error.h"
#include "npy.h"

namespace flowmoe {
namespace cli {
namespace {

// "dir/name" -> "dir" ("." when there is no directory part; "/" for "/name").
std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}
std::string base_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// The message of a flowmoe::Error without its "source.cpp:LINE: " prefix.
std::string message_of(const Error& e) {
  const std::string s = e.what();
  const size_t at = s.find(": ");
  return at == std::string::npos ? s : s.substr(at + 2);
}

// A unique name in the directory of `path`, short so that it fits wherever the final name does.
std::string temp_name(const std::string& path, const char* kind) {
  static int counter = 0;
  const std::string dir = dir_of(path);
  return (dir == "/" ? "" : dir) + "/.flowmoe-" + std::to_string(static_cast<long>(getpid())) + "-" +
         std::to_string(counter++) + kind;
}

bool exists_no_follow(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

}  // namespace

OutputSet::~OutputSet() {
  if (!committed_) rollback();
}

void OutputSet::add(const std::string& path, const char* dtype, const std::vector<int64_t>& shape,
                    const void* data) {
  FLOWMOE_CHECK(!committed_, "internal: OutputSet::add after commit");
  FLOWMOE_CHECK(!path.empty() && base_of(path) != "" && base_of(path) != "." && base_of(path) != "..",
                "'" << path << "': not a file name");
  for (const Item& it : items_)
    FLOWMOE_CHECK(it.path != path, "internal: " << path << " is written twice in one set");
  const std::string dir = dir_of(path);
  struct stat st;
  FLOWMOE_CHECK(stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode),
                path << ": cannot write: directory '" << dir << "' does not exist");
  const long name_max = pathconf(dir.c_str(), _PC_NAME_MAX);
  const size_t limit = name_max > 0 ? static_cast<size_t>(name_max) : 255;
  FLOWMOE_CHECK(base_of(path).size() <= limit,
                path << ": cannot write: file name too long (" << base_of(path).size()
                     << " bytes, the file system allows " << limit << "; use a shorter prefix)");
  if (stat(path.c_str(), &st) == 0)
    FLOWMOE_CHECK(S_ISREG(st.st_mode), path << ": cannot write: it exists and is not a regular file");

  Item it;
  it.path = path;
  it.tmp = temp_name(path, ".tmp");
  it.line = path + " " + npy_dtype_name(dtype) + " " + npy_shape_str(shape);
  items_.push_back(it);  // from here on the destructor removes the temporary
  try {
    npy_save(it.tmp, dtype, shape, data);
  } catch (const Error& e) {
    throw Error(__FILE__, __LINE__,
                path + ": cannot write (nothing of the output set was written): " + message_of(e));
  }
}

void OutputSet::commit() {
  FLOWMOE_CHECK(!committed_, "internal: OutputSet committed twice");
  // On a failed rename, rollback() clears items_: the message takes a copy of the path first.
  for (Item& it : items_) {
    if (exists_no_follow(it.path)) {
      it.backup = temp_name(it.path, ".old");
      if (std::rename(it.path.c_str(), it.backup.c_str()) != 0) {
        const std::string why = std::strerror(errno), path = it.path;
        rollback();
        throw Error(__FILE__, __LINE__, path + ": cannot replace it (" + why + "); nothing was written");
      }
      it.backed_up = true;
    }
    if (std::rename(it.tmp.c_str(), it.path.c_str()) != 0) {
      const std::string why = std::strerror(errno), path = it.path;
      rollback();
      throw Error(__FILE__, __LINE__, path + ": cannot create it (" + why + "); nothing was written");
    }
    it.installed = true;
  }
  committed_ = true;
  for (Item& it : items_) {
    if (it.backed_up) std::remove(it.backup.c_str());
    std::cout << "wrote " << it.line << "\n";
  }
}

void OutputSet::rollback() {
  // Undo in reverse order: remove what was installed, put the old files back, drop temporaries.
  for (auto i = items_.rbegin(); i != items_.rend(); ++i) {
    if (i->installed) std::remove(i->path.c_str());
    else std::remove(i->tmp.c_str());
    if (i->backed_up) std::rename(i->backup.c_str(), i->path.c_str());
    i->installed = i->backed_up = false;
  }
  items_.clear();
}

}  // namespace cli
}  // namespace flowmoe
