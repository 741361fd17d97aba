// All-or-nothing output of a set of .npy files (see output_set.h).
#include "output_set.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <memory>

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

// lstat's file type of `path`: 0 when nothing is there.
mode_t type_no_follow(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 ? (st.st_mode & S_IFMT) : 0;
}

// An exclusive advisory lock on a directory (flock on its descriptor), held while a set is put in
// place: two flowmoe processes committing sets into one directory take turns, so neither sees, moves
// or removes the other's half-installed files. Nothing is created in the directory.
class DirLock {
 public:
  // Where no lock can be had (a writable but unreadable directory, a file system without flock)
  // the set is still committed, without one, and a warning says so.
  explicit DirLock(const std::string& dir) {
    fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int err = fd_ < 0 ? errno : 0;
    while (fd_ >= 0 && flock(fd_, LOCK_EX) != 0) {
      if (errno == EINTR) continue;
      err = errno;
      ::close(fd_);
      fd_ = -1;
    }
    if (fd_ < 0)
      std::cerr << "flowmoe: warning: " << dir << ": the output directory cannot be locked (" << std::strerror(err)
                << "); a concurrent writer of the same names could mix the two sets\n";
  }
  ~DirLock() {
    if (fd_ >= 0) ::close(fd_);  // (releases the lock)
  }
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace

OutputSet::~OutputSet() {
  if (committed_) return;
  const std::string undo = rollback();
  if (!undo.empty()) std::cerr << "flowmoe: " << undo << "\n";
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
  std::vector<std::string> dirs;  // each output directory locked once, in a fixed order
  for (const Item& it : items_) dirs.push_back(dir_of(it.path));
  std::sort(dirs.begin(), dirs.end());
  dirs.erase(std::unique(dirs.begin(), dirs.end()), dirs.end());
  std::vector<std::unique_ptr<DirLock>> locks;
  for (const std::string& d : dirs) locks.push_back(std::make_unique<DirLock>(d));
  // On a failure, fail() rolls back (which clears items_) and says whether that worked.
  const auto fail = [this](std::string path, const std::string& what) {  // (path copied: rollback clears items_)
    const std::string undo = rollback();
    throw Error(__FILE__, __LINE__,
                path + ": " + what + (undo.empty() ? "; nothing was written" : "; " + undo));
  };
  for (Item& it : items_) {
    const mode_t there = type_no_follow(it.path);
    if (there != 0 && there != S_IFREG && there != S_IFLNK)  // (a directory appeared since add())
      fail(it.path, "cannot replace it: it exists and is not a regular file");
    if (there != 0) {
      it.backup = temp_name(it.path, ".old");
      if (std::rename(it.path.c_str(), it.backup.c_str()) != 0)
        fail(it.path, std::string("cannot replace it (") + std::strerror(errno) + ")");
      it.backed_up = true;
      const mode_t moved = type_no_follow(it.backup);
      if (moved != S_IFREG && moved != S_IFLNK)  // (it became one between the check and the move)
        fail(it.path, "cannot replace it: it exists and is not a regular file");
    }
    if (std::rename(it.tmp.c_str(), it.path.c_str()) != 0)
      fail(it.path, std::string("cannot create it (") + std::strerror(errno) + ")");
    it.installed = true;
  }
  committed_ = true;
  std::string left;
  for (Item& it : items_) {
    if (it.backed_up && std::remove(it.backup.c_str()) != 0) left += " " + it.backup;
    std::cout << "wrote " << it.line << "\n";
  }
  if (!left.empty())  // the new set is complete; only the old files could not be removed
    std::cerr << "flowmoe: warning: the replaced files could not be removed:" << left << "\n";
}

std::string OutputSet::rollback() {
  // Undo in reverse order: remove what was installed, put the old files back, drop temporaries.
  // Every step that fails is reported: the set on disk is then not the old one.
  std::string failed;
  const auto step = [&failed](bool ok, const std::string& what) {
    if (!ok) failed += (failed.empty() ? "" : "; ") + what + " (" + std::strerror(errno) + ")";
  };
  for (auto i = items_.rbegin(); i != items_.rend(); ++i) {
    if (i->installed)
      step(std::remove(i->path.c_str()) == 0, "could not remove the new " + i->path);
    else if (type_no_follow(i->tmp) != 0)
      step(std::remove(i->tmp.c_str()) == 0, "could not remove the temporary " + i->tmp);
    if (i->backed_up)
      step(std::rename(i->backup.c_str(), i->path.c_str()) == 0,
           "could not put " + i->path + " back (the old file is left as " + i->backup + ")");
    i->installed = i->backed_up = false;
  }
  items_.clear();
  return failed.empty() ? failed
                        : "the rollback failed too, so the files of this set on disk are not the old ones: " + failed;
}

}  // namespace cli
}  // namespace flowmoe
