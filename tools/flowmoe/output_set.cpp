// All-or-nothing output of a set of .npy files (see output_set.h).
#include "output_set.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>

#include "flowmoe/error.h"
#include "npy.h"
#include "set_files.h"

namespace flowmoe {
namespace cli {
namespace {

// lstat's file type of `path`: 0 when nothing is there.
mode_t type_no_follow(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 ? (st.st_mode & S_IFMT) : 0;
}

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

  FLOWMOE_CHECK(items_.empty() || dir == dir_,
                "internal: the files of one output set must be in one directory (" << path << ")");
  FLOWMOE_CHECK(base_of(path).compare(0, 9, ".flowmoe-") != 0,
                path << ": cannot write: names starting with '.flowmoe-' are flowmoe's temporary files "
                     << "(removed as leftovers); choose another name");

  Item it;
  it.path = path;
  it.line = path + " " + npy_dtype_name(dtype) + " " + npy_shape_str(shape);
  install_signal_handlers();
  TempFile t;
  {
    SignalBlock block;  // created and registered at once: a signal then removes it
    t = create_temp(dir, "tmp", path);
    it.tmp = t.path;
    register_temp(t.path);
    dir_ = dir;
    items_.push_back(it);  // from here on the destructor (or a signal) removes the temporary
  }
  std::string failed;
  try {
    npy_write(t.fd, path, dtype, shape, data);
  } catch (const Error& e) {
    failed = e.message();
  }
  if (::close(t.fd) != 0 && failed.empty()) failed = path + ": write failed (" + std::strerror(errno) + ")";
  if (!failed.empty())
    throw Error(__FILE__, __LINE__, path + ": cannot write (nothing of the output set was written): " + failed);
}

void OutputSet::commit() {
  FLOWMOE_CHECK(!committed_, "internal: OutputSet committed twice");
  if (items_.empty()) return;
  // Waiting for the lock, a signal still ends the process (removing the temporaries); from here on
  // it waits until the set is whole or rolled back.
  const DirLock lock(dir_, true);
  const SignalBlock block;
  clean_up_after_killed_writers(dir_);
  // On a failure, fail() rolls back (which clears items_) and says whether that worked.
  const auto fail = [this](std::string path, const std::string& what) {  // (path copied: rollback clears items_)
    const std::string undo = rollback();
    throw Error(__FILE__, __LINE__,
                path + ": " + what + (undo.empty() ? "; nothing was written" : "; " + undo));
  };
  std::vector<JournalEntry> journal;
  for (Item& it : items_) {
    const mode_t there = type_no_follow(it.path);
    if (there != 0 && there != S_IFREG && there != S_IFLNK)  // (a directory appeared since add())
      fail(it.path, "cannot replace it: it exists and is not a regular file");
    if (there != 0) it.backup = temp_name(dir_, "old");
    journal.push_back({base_of(it.path), base_of(it.tmp), it.backup.empty() ? "" : base_of(it.backup)});
  }
  try {
    journal_ = write_journal(dir_, journal);
  } catch (const Error& e) {
    fail(items_[0].path, e.message());
  }
  for (Item& it : items_) {
    if (!it.backup.empty()) {
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
  // The commit point: with the journal gone the new set is the set (a killed process's leftover
  // old files are then only removed).
  const bool journal_removed = ::unlink(journal_.c_str()) == 0;
  const std::string journal_left = journal_;
  journal_.clear();
  committed_ = true;
  std::string left;
  for (Item& it : items_) {
    unregister_temp(it.tmp);
    if (it.backed_up && std::remove(it.backup.c_str()) != 0) left += " " + it.backup;
    std::cout << "wrote " << it.line << "\n";
  }
  if (!journal_removed) left += " " + journal_left;
  if (!left.empty())  // the new set is complete; only the old files could not be removed
    std::cerr << "flowmoe: warning: the replaced files could not be removed:" << left << "\n";
}

std::string OutputSet::rollback() {
  // Undo in reverse order: remove what was installed, put the old files back, drop temporaries.
  // Every step that fails is reported: the set on disk is then not the old one.
  const SignalBlock block;
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
    unregister_temp(i->tmp);
    i->installed = i->backed_up = false;
  }
  items_.clear();
  if (!journal_.empty()) {
    // Kept when the rollback failed: readers then refuse the set, and the next writer finishes it.
    if (failed.empty()) step(::unlink(journal_.c_str()) == 0, "could not remove the commit record " + journal_);
    else failed += "; the record " + journal_ + " is kept: readers refuse the set until the next flowmoe write into '" +
                   dir_ + "' puts the old files back";
    journal_.clear();
  }
  return failed.empty() ? failed
                        : "the rollback failed too, so the files of this set on disk are not the old ones: " + failed;
}

}  // namespace cli
}  // namespace flowmoe
