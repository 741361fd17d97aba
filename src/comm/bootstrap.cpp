// Bootstrap helpers of the communicators (flowmoe/comm.h), backend independent: torchrun's
// environment, a TCP broadcast from rank 0 (used for the ncclUniqueId) with a consistency check of
// every rank's world size and fingerprint, the NVLS guard and the single-node launcher.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "flowmoe/comm.h"

namespace flowmoe {

namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double s) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}
int ms_left(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(left > 1000000 ? 1000000 : left);
}

int parse_env_int(const char* name, const char* fallback_name, int fallback, bool required) {
  const char* v = std::getenv(name);
  if (!v && fallback_name) v = std::getenv(fallback_name);
  if (!v) {
    FLOWMOE_CHECK(!required, "bootstrap: environment variable " << name
                                 << " is not set; expected torchrun's RANK, WORLD_SIZE "
                                    "(and optionally LOCAL_RANK, MASTER_ADDR, MASTER_PORT)");
    return fallback;
  }
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  FLOWMOE_CHECK(errno == 0 && end != v && *end == '\0' && x >= 0 && x <= 0x7FFFFFFF,
                "bootstrap: " << name << "=\"" << v << "\"; expected a non-negative integer");
  return static_cast<int>(x);
}

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { if (fd_ >= 0) ::close(fd_); }
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept { std::swap(fd_, o.fd_); return *this; }
  Fd(const Fd&) = delete;
  int get() const { return fd_; }
 private:
  int fd_;
};

[[noreturn]] void comm_fail(const std::string& msg) { throw CommError(__FILE__, __LINE__, msg); }

void io_full(int fd, void* buf, size_t n, bool write, Clock::time_point deadline,
             const char* what) {
  uint8_t* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    pollfd pf{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    const int r = ::poll(&pf, 1, ms_left(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) comm_fail(std::string("bootstrap: timed out ") + what);
    if (r < 0) comm_fail(std::string("bootstrap: poll failed ") + what + ": " + std::strerror(errno));
    const ssize_t k = write ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0)
      comm_fail(std::string("bootstrap: connection closed ") + what +
                (k < 0 ? std::string(": ") + std::strerror(errno) : std::string()));
    p += k;
    n -= static_cast<size_t>(k);
  }
}
void put_u32(std::vector<uint8_t>& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
uint32_t get_u32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}
constexpr uint32_t kMagic = 0x50454D46u;  // "FMEP"
constexpr uint32_t kMaxMsg = 1u << 20;

void send_msg(int fd, uint32_t status, const std::vector<uint8_t>& body,
              Clock::time_point deadline, const char* what) {
  std::vector<uint8_t> b;
  put_u32(b, status);
  put_u32(b, static_cast<uint32_t>(body.size()));
  b.insert(b.end(), body.begin(), body.end());
  io_full(fd, b.data(), b.size(), true, deadline, what);
}

}  // namespace

BootstrapEnv bootstrap_env_from_environment() {
  BootstrapEnv env;
  // rank / size / local rank / local size variables of each launcher, first match wins
  struct Launcher {
    const char* name;
    const char *rank, *size, *local_rank, *local_size;
  };
  static const Launcher kLaunchers[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"MPICH / Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr},
  };
  const Launcher* l = nullptr;
  for (const Launcher& c : kLaunchers)
    if (std::getenv(c.rank)) {
      l = &c;
      break;
    }
  FLOWMOE_CHECK(l != nullptr, "bootstrap: no rank variable is set; expected torchrun's RANK and "
                              "WORLD_SIZE (and optionally LOCAL_RANK, MASTER_ADDR, MASTER_PORT), "
                              "or an MPI / Slurm launcher's (OMPI_COMM_WORLD_RANK, PMI_RANK, "
                              "SLURM_PROCID)");
  env.launcher = l->name;
  env.rank = parse_env_int(l->rank, nullptr, 0, true);
  env.world_size = parse_env_int(l->size, nullptr, 1, true);
  env.local_rank = parse_env_int(l->local_rank, l->rank, env.rank, false);
  env.local_world_size = l->local_size ? parse_env_int(l->local_size, l->size, env.world_size, false)
                                       : env.world_size;
  if (const char* a = std::getenv("MASTER_ADDR")) env.master_addr = a;
  env.master_port = parse_env_int("MASTER_PORT", nullptr, 29500, false);
  FLOWMOE_CHECK(env.world_size >= 1 && env.rank < env.world_size,
                "bootstrap: RANK=" << env.rank << " WORLD_SIZE=" << env.world_size
                                   << "; expected 0 <= RANK < WORLD_SIZE");
  FLOWMOE_CHECK(env.master_port >= 1 && env.master_port <= 65535,
                "bootstrap: MASTER_PORT=" << env.master_port << "; expected 1..65535");
  return env;
}

std::vector<uint8_t> tcp_broadcast_from_root(const BootstrapEnv& env,
                                             const std::vector<uint8_t>& payload,
                                             const std::string& fingerprint, double timeout_s) {
  FLOWMOE_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size,
                "tcp_broadcast_from_root: rank " << env.rank << " of " << env.world_size);
  FLOWMOE_CHECK(payload.size() <= kMaxMsg && fingerprint.size() <= kMaxMsg,
                "tcp_broadcast_from_root: payload or fingerprint larger than " << kMaxMsg);
  if (env.world_size == 1) return payload;
  const auto deadline = deadline_after(timeout_s);
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);

  if (env.rank == 0) {
    Fd ls(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (ls.get() < 0) comm_fail(std::string("bootstrap: socket: ") + std::strerror(errno));
    int one = 1;
    ::setsockopt(ls.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(env.master_port));
    if (::bind(ls.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
      comm_fail("bootstrap: rank 0 cannot listen on port " + std::to_string(env.master_port) +
                ": " + std::strerror(errno) + " (MASTER_PORT in use?)");
    if (::listen(ls.get(), env.world_size) != 0)
      comm_fail(std::string("bootstrap: listen: ") + std::strerror(errno));
    std::vector<Fd> peers;
    std::vector<int> seen(env.world_size, 0);
    seen[0] = 1;
    std::string error;
    // After an error, keep accepting for a short while so that ranks still connecting hear it too.
    auto accept_deadline = deadline;
    while (static_cast<int>(peers.size()) < env.world_size - 1) {
      pollfd pf{ls.get(), POLLIN, 0};
      const int r = ::poll(&pf, 1, ms_left(accept_deadline));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0 && !error.empty()) break;
      if (r <= 0) {
        std::string missing;
        for (int q = 1; q < env.world_size; ++q)
          if (!seen[q]) missing += " " + std::to_string(q);
        error = "bootstrap: rank 0 timed out after " + std::to_string(timeout_s) +
                " s waiting for rank(s)" + missing + " to connect to " + where;
        break;
      }
      Fd c(::accept4(ls.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (c.get() < 0) continue;
      uint8_t hdr[16];
      io_full(c.get(), hdr, sizeof(hdr), false, deadline, "reading a rank's hello");
      const uint32_t magic = get_u32(hdr), rank = get_u32(hdr + 4), world = get_u32(hdr + 8),
                     fl = get_u32(hdr + 12);
      if (magic != kMagic || fl > kMaxMsg) continue;  // not one of ours: ignore the connection
      std::string fp(fl, '\0');
      if (fl) io_full(c.get(), &fp[0], fl, false, deadline, "reading a rank's fingerprint");
      if (error.empty()) {
        if (static_cast<int>(world) != env.world_size)
          error = "bootstrap: rank " + std::to_string(rank) + " has WORLD_SIZE=" +
                  std::to_string(world) + " but rank 0 has WORLD_SIZE=" +
                  std::to_string(env.world_size);
        else if (rank == 0 || static_cast<int>(rank) >= env.world_size || seen[rank])
          error = "bootstrap: rank " + std::to_string(rank) +
                  " connected twice or is out of range (WORLD_SIZE=" +
                  std::to_string(env.world_size) + ")";
        else if (fp != fingerprint)
          error = "bootstrap: mismatched configuration: rank " + std::to_string(rank) + " has \"" +
                  fp + "\" but rank 0 has \"" + fingerprint + "\"";
      }
      if (static_cast<int>(rank) < env.world_size) seen[rank] = 1;
      peers.push_back(std::move(c));
      if (!error.empty()) accept_deadline = std::min(deadline, deadline_after(2.0));
    }
    const std::vector<uint8_t> body =
        error.empty() ? payload : std::vector<uint8_t>(error.begin(), error.end());
    for (const Fd& c : peers) {
      try {
        send_msg(c.get(), error.empty() ? 0 : 1, body, deadline, "sending the payload");
      } catch (const CommError&) {
        // the peer is gone; the others still get their answer
      }
    }
    if (!error.empty()) comm_fail(error);
    return payload;
  }

  // Ranks > 0: connect (rank 0 may not listen yet), say hello, wait for the answer.
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  const int gai = ::getaddrinfo(env.master_addr.c_str(), std::to_string(env.master_port).c_str(),
                                &hints, &res);
  if (gai != 0 || !res) comm_fail("bootstrap: cannot resolve MASTER_ADDR " + where + ": " +
                                  ::gai_strerror(gai));
  Fd s;
  while (true) {
    Fd c(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (c.get() >= 0 && ::connect(c.get(), res->ai_addr, res->ai_addrlen) == 0) {
      s = std::move(c);
      break;
    }
    if (ms_left(deadline) == 0) {
      ::freeaddrinfo(res);
      comm_fail("bootstrap: rank " + std::to_string(env.rank) + " could not connect to rank 0 at " +
                where + " within " + std::to_string(timeout_s) + " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::freeaddrinfo(res);
  int one = 1;
  ::setsockopt(s.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::vector<uint8_t> hello;
  put_u32(hello, kMagic);
  put_u32(hello, static_cast<uint32_t>(env.rank));
  put_u32(hello, static_cast<uint32_t>(env.world_size));
  put_u32(hello, static_cast<uint32_t>(fingerprint.size()));
  hello.insert(hello.end(), fingerprint.begin(), fingerprint.end());
  io_full(s.get(), hello.data(), hello.size(), true, deadline, "sending the hello to rank 0");
  uint8_t hdr[8];
  io_full(s.get(), hdr, sizeof(hdr), false, deadline, "waiting for rank 0's answer");
  const uint32_t status = get_u32(hdr), len = get_u32(hdr + 4);
  if (len > kMaxMsg) comm_fail("bootstrap: malformed answer from rank 0");
  std::vector<uint8_t> body(len);
  if (len) io_full(s.get(), body.data(), len, false, deadline, "reading rank 0's answer");
  if (status != 0) comm_fail(std::string(body.begin(), body.end()) + " (reported by rank 0)");
  return body;
}

void ensure_nvls_disabled() {
  const char* v = std::getenv("NCCL_NVLS_ENABLE");
  if (v && std::strcmp(v, "0") == 0) return;
  if (v)
    std::fprintf(stderr,
                 "flowmoe: NCCL_NVLS_ENABLE=%s overridden to 0 (NVLink multicast must stay off)\n",
                 v);
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
}

LaunchResult launch_local_ranks_ex(const std::vector<std::string>& argv, int nprocs,
                                   int master_port, const LaunchOptions& opt) {
  FLOWMOE_CHECK(!argv.empty(), "launch_local_ranks: empty command");
  FLOWMOE_CHECK(nprocs >= 1 && nprocs <= 1024,
                "launch_local_ranks: nprocs " << nprocs << "; expected 1..1024");
  FLOWMOE_CHECK(master_port >= 1 && master_port <= 65535,
                "launch_local_ranks: port " << master_port << "; expected 1..65535");
  for (const std::string& e : opt.env)
    FLOWMOE_CHECK(e.find('=') != std::string::npos && e.find('=') > 0,
                  "launch_local_ranks: environment entry '" << e << "' is not NAME=VALUE");
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::fflush(nullptr);
  const auto start = Clock::now();
  std::vector<pid_t> pids;
  for (int i = 0; i < nprocs; ++i) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (pid_t p : pids) ::kill(p, SIGTERM);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
      FLOWMOE_CHECK(false, "launch_local_ranks: fork failed: " << std::strerror(errno));
    }
    if (pid == 0) {
      for (const std::string& e : opt.env) {
        const size_t eq = e.find('=');
        ::setenv(e.substr(0, eq).c_str(), e.substr(eq + 1).c_str(), 1);
      }
      const std::string r = std::to_string(i), n = std::to_string(nprocs),
                        port = std::to_string(master_port);
      ::setenv("RANK", r.c_str(), 1);
      ::setenv("LOCAL_RANK", r.c_str(), 1);
      ::setenv("WORLD_SIZE", n.c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", n.c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::setenv("NCCL_NVLS_ENABLE", "0", 1);
      ::execvp(args[0], args.data());
      std::fprintf(stderr, "flowmoe launch: cannot run %s: %s\n", args[0], std::strerror(errno));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  LaunchResult res;
  res.exit_codes.assign(nprocs, 0);
  res.seconds.assign(nprocs, 0.0);
  std::vector<bool> done(nprocs, false);
  int remaining = nprocs;
  bool termed = false, killed = false, stopping = false;
  Clock::time_point term_at{}, kill_at{};
  const bool has_deadline = opt.timeout_s > 0;
  const Clock::time_point deadline = has_deadline ? deadline_after(opt.timeout_s) : Clock::time_point{};
  while (remaining > 0) {
    bool reaped = false;
    for (int i = 0; i < nprocs; ++i) {  // only our children (never waitpid(-1))
      if (done[i]) continue;
      int status = 0;
      const pid_t pid = ::waitpid(pids[i], &status, WNOHANG);
      if (pid != pids[i]) continue;
      reaped = true;
      done[i] = true;
      --remaining;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status)
                                         : (WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1);
      res.exit_codes[i] = code;
      res.seconds[i] = std::chrono::duration<double>(Clock::now() - start).count();
      // ranks stopped by the watchdog are not failures of their own (the result says timed_out)
      if (code != 0 && res.first_failure == 0 && !res.timed_out) {
        res.first_failure = code;
        res.first_failed_rank = i;
        if (opt.stop_on_failure) {
          std::fprintf(stderr, "flowmoe launch: rank %d exited with status %d%s\n", i, code,
                       remaining ? "; stopping the other ranks" : "");
          if (!stopping) {
            stopping = true;
            term_at = deadline_after(opt.grace_s);
            kill_at = deadline_after(opt.grace_s + 5.0);
          }
        } else {
          std::fprintf(stderr, "flowmoe launch: rank %d exited with status %d\n", i, code);
        }
      }
    }
    if (reaped) continue;
    const auto now = Clock::now();
    if (has_deadline && !res.timed_out && now >= deadline) {
      res.timed_out = true;
      std::fprintf(stderr,
                   "flowmoe launch: timeout of %.1f s reached; stopping %d rank(s) still running\n",
                   opt.timeout_s, remaining);
      if (!stopping || term_at > now) {
        stopping = true;
        term_at = now;
        kill_at = deadline_after(5.0);
      }
    }
    if (stopping) {
      if (!termed && now >= term_at) {
        for (int i = 0; i < nprocs; ++i)
          if (!done[i]) ::kill(pids[i], SIGTERM);
        termed = true;
      }
      if (!killed && now >= kill_at) {
        for (int i = 0; i < nprocs; ++i)
          if (!done[i]) ::kill(pids[i], SIGKILL);
        killed = true;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return res;
}

int launch_local_ranks(const std::vector<std::string>& argv, int nprocs, int master_port,
                       double grace_s) {
  LaunchOptions opt;
  opt.grace_s = grace_s;
  const LaunchResult r = launch_local_ranks_ex(argv, nprocs, master_port, opt);
  return r.first_failure != 0 ? r.first_failure : (r.timed_out ? 124 : 0);
}

}  // namespace flowmoe
