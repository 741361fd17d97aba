// Expert parallelism on the CPU (flowmoe/comm.h, docs/EP.md): the simulated communicator, the
// dispatch/combine plan and payload movement for 1, 2, 4 and 8 ranks, bit-exactness of EP = N
// against one rank, error detection without hangs, the TCP bootstrap and the local launcher.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "flowmoe/comm.h"
#include "flowmoe/numerics.h"
#include "flowmoe/token.h"

namespace flowmoe {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void expect_all_ok(const std::vector<std::string>& errs) {
  for (size_t r = 0; r < errs.size(); ++r) EXPECT_EQ(errs[r], "") << "rank " << r;
}

// One rank's input: tokens, ids (some dropped, some experts unused), probs, BF16 rows.
struct RankInput {
  int64_t tokens = 0;
  std::vector<int32_t> ids;
  std::vector<float> probs;
  std::vector<bf16_t> x;
};

// Rank r gets tokens[r] tokens (0 allowed); experts >= `used` never get a token; a fraction of
// slots is dropped (-1). Ids of one token are distinct.
std::vector<RankInput> make_inputs(const std::vector<int64_t>& tokens, int k, int e, int used,
                                   int64_t h, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<RankInput> in(tokens.size());
  for (size_t r = 0; r < tokens.size(); ++r) {
    RankInput& ri = in[r];
    ri.tokens = tokens[r];
    ri.ids.assign(ri.tokens * k, -1);
    ri.probs.resize(ri.tokens * k);
    for (int64_t t = 0; t < ri.tokens; ++t) {
      std::vector<int> pool(used);
      for (int i = 0; i < used; ++i) pool[i] = i;
      std::shuffle(pool.begin(), pool.end(), rng);
      for (int s = 0; s < k; ++s) {
        ri.ids[t * k + s] = (s < used && rng() % 8 != 0) ? pool[s] : -1;
        ri.probs[t * k + s] = std::uniform_real_distribution<float>(0.01f, 1.0f)(rng);
      }
    }
    ri.x.resize(ri.tokens * h);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : ri.x) v = num::f32_to_bf16(nd(rng));
  }
  return in;
}

// Concatenation of every rank's tokens, rank 0 first: the single-rank batch.
RankInput concat(const std::vector<RankInput>& in, int64_t h) {
  RankInput all;
  for (const RankInput& r : in) {
    all.tokens += r.tokens;
    all.ids.insert(all.ids.end(), r.ids.begin(), r.ids.end());
    all.probs.insert(all.probs.end(), r.probs.begin(), r.probs.end());
    all.x.insert(all.x.end(), r.x.begin(), r.x.end());
  }
  (void)h;
  return all;
}

std::vector<int64_t> tokens_for(int world, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int64_t> t(world);
  for (int r = 0; r < world; ++r) t[r] = 1 + rng() % 24;
  if (world >= 2) t[1] = 0;  // a rank with no tokens sends nothing
  return t;
}

float encode(int src, int64_t t, int s) { return static_cast<float>(src * 1048576 + t * 32 + s); }

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

const int kWorlds[] = {1, 2, 4, 8};

// ---- the simulated communicator ---------------------------------------------------------------
TEST(CommSim, AlltoallAndAlltoallv) {
  for (int n : kWorlds) {
    SimWorld world(n, 10.0);
    const auto errs = world.run([&](Communicator& c) {
      const int me = c.rank();
      ASSERT_EQ(c.world_size(), n);
      std::vector<int32_t> send(3 * n), recv(3 * n, -1);
      for (int p = 0; p < n; ++p)
        for (int i = 0; i < 3; ++i) send[p * 3 + i] = me * 10000 + p * 10 + i;
      c.alltoall_i32(send.data(), recv.data(), 3);
      for (int p = 0; p < n; ++p)
        for (int i = 0; i < 3; ++i) EXPECT_EQ(recv[p * 3 + i], p * 10000 + me * 10 + i);
      // alltoallv: rank me sends (me + p) % 3 bytes to p (zero included), valued me*16 + p.
      std::vector<int64_t> sc(n), so(n), rc(n), ro(n);
      int64_t st = 0, rt = 0;
      for (int p = 0; p < n; ++p) {
        sc[p] = (me + p) % 3; so[p] = st; st += sc[p];
        rc[p] = (p + me) % 3; ro[p] = rt; rt += rc[p];
      }
      std::vector<uint8_t> sb(st), rb(rt, 0xEE);
      for (int p = 0; p < n; ++p)
        for (int64_t i = 0; i < sc[p]; ++i) sb[so[p] + i] = static_cast<uint8_t>(me * 16 + p);
      c.alltoallv(sb.data(), sc.data(), so.data(), rb.data(), rc.data(), ro.data());
      for (int p = 0; p < n; ++p)
        for (int64_t i = 0; i < rc[p]; ++i) EXPECT_EQ(rb[ro[p] + i], p * 16 + me);
      c.barrier();
      c.synchronize();
      EXPECT_EQ(c.error(), "");
    });
    expect_all_ok(errs);
  }
}

// The device-memory world's protocol, exercised on the CPU with a host Copier standing in for
// the CUDA copies (make_device_sim_world supplies cudaMemcpyAsync + a stream wait): every chunk
// goes through copy() on the receiving rank's thread, wait() once per exchange per rank, and a
// failing copy fails the exchange on every rank.
TEST(CommSim, DeviceWorldCopiesThroughItsCopier) {
  for (int n : {1, 2, 4}) {
    std::vector<std::atomic<int>> copies(n), waits(n);
    SimWorld::Copier cp;
    cp.copy = [&](int rank, void* dst, const void* src, int64_t bytes) {
      std::memcpy(dst, src, size_t(bytes));
      ++copies[rank];
    };
    cp.wait = [&](int rank) { ++waits[rank]; };
    std::vector<std::vector<uint8_t>> scratch(n);
    cp.copy_local = [](int, const std::vector<CopyPiece>& pieces) {
      for (const CopyPiece& c : pieces) std::memcpy(c.dst, c.src, size_t(c.bytes));
    };
    cp.scratch = [&](int rank, int64_t bytes) -> void* {
      if (int64_t(scratch[rank].size()) < bytes) scratch[rank].resize(size_t(bytes));
      return scratch[rank].data();
    };
    SimWorld world(n, 10.0, MemorySpace::kDevice, cp);
    EXPECT_EQ(world.memory_space(), MemorySpace::kDevice);
    const auto errs = world.run([&](Communicator& c) {
      const int me = c.rank();
      EXPECT_EQ(c.memory_space(), MemorySpace::kDevice);
      std::vector<std::vector<int32_t>> out(n), in(n);
      std::vector<P2pOp> sends, recvs;
      for (int p = 0; p < n; ++p) {
        out[p].assign(p + 1, me * 100 + p);
        in[p].assign(me + 1, -1);
        sends.push_back({p, out[p].data(), int64_t(4 * out[p].size())});
        recvs.push_back({p, in[p].data(), int64_t(4 * in[p].size())});
      }
      c.exchange(sends, recvs);
      for (int p = 0; p < n; ++p)
        for (int32_t v : in[p]) EXPECT_EQ(v, p * 100 + me);
    });
    expect_all_ok(errs);
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(copies[r].load(), n);
      EXPECT_EQ(waits[r].load(), 1);
    }
  }
  // a failing copy: CommError on every rank, naming the copy
  SimWorld::Copier bad;
  bad.copy = [](int, void*, const void*, int64_t) { throw Error(__FILE__, __LINE__, "boom"); };
  bad.wait = [](int) {};
  bad.copy_local = [](int, const std::vector<CopyPiece>&) {};
  bad.scratch = [](int, int64_t) -> void* { return nullptr; };
  SimWorld world(2, 10.0, MemorySpace::kDevice, bad);
  const auto errs = world.run([&](Communicator& c) {
    int32_t a = 1, b = 0;
    const int peer = 1 - c.rank();
    c.exchange({{peer, &a, 4}}, {{peer, &b, 4}});
  });
  for (const std::string& e : errs) EXPECT_NE(e.find("device copy"), std::string::npos) << e;
  // a device world without a copier is an error; the host world is unchanged
  EXPECT_THROW(SimWorld(2, 10.0, MemorySpace::kDevice, SimWorld::Copier()), Error);
  EXPECT_EQ(SimWorld(2).memory_space(), MemorySpace::kHost);
}

TEST(CommSim, MissingRankTimesOutWithClearError) {
  SimWorld world(3, 0.2);
  const auto t0 = Clock::now();
  const auto errs = world.run([&](Communicator& c) {
    if (c.rank() == 2) return;  // never joins: a dead rank
    c.barrier();
  });
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_EQ(errs[2], "");
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errs[r].find("timed out after 0.2 s"), std::string::npos) << errs[r];
    EXPECT_NE(errs[r].find("waiting for rank(s) 2"), std::string::npos) << errs[r];
  }
}

TEST(CommSim, MismatchedCallsAndSizesAreErrors) {
  {
    SimWorld world(2, 5.0);
    const auto errs = world.run([&](Communicator& c) {
      std::vector<int32_t> s(2 * (c.rank() + 1)), r(s.size());
      c.alltoall_i32(s.data(), r.data(), c.rank() + 1);
    });
    for (const auto& e : errs)
      EXPECT_NE(e.find("rank 0 exchanges 1 ints per peer but rank 1 exchanges 2"), std::string::npos) << e;
  }
  {
    SimWorld world(2, 5.0);
    const auto errs = world.run([&](Communicator& c) {
      std::vector<uint8_t> b(16);
      // rank 0 sends 8 bytes to rank 1, rank 1 expects 4
      std::vector<P2pOp> sends, recvs;
      if (c.rank() == 0) sends.push_back({1, b.data(), 8});
      if (c.rank() == 1) recvs.push_back({0, b.data(), 4});
      c.exchange(sends, recvs);
    });
    for (const auto& e : errs)
      EXPECT_NE(e.find("rank 1 expects 1 chunk(s) [4 bytes] from rank 0 but rank 0 sends 1 "
                       "chunk(s) [8 bytes]"),
                std::string::npos)
          << e;
  }
  {
    SimWorld world(2, 5.0);
    const auto errs = world.run([&](Communicator& c) {
      if (c.rank() == 0) c.barrier();
      else { int32_t a[2] = {0, 0}, b[2]; c.alltoall_i32(a, b, 1); }
    });
    for (const auto& e : errs)
      EXPECT_NE(e.find("rank 0 called barrier #1 but rank 1 called alltoall_i32 #1"),
                std::string::npos)
          << e;
  }
}

TEST(CommSim, FailingRankAbortsPeersFast) {
  SimWorld world(4, 30.0);  // long timeout: the abort, not the timeout, must end the wait
  const auto t0 = Clock::now();
  const auto errs = world.run([&](Communicator& c) {
    if (c.rank() == 3) throw std::runtime_error("bad input on rank 3");
    c.barrier();
  });
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_NE(errs[3].find("bad input on rank 3"), std::string::npos);
  for (int r = 0; r < 3; ++r)
    EXPECT_NE(errs[r].find("aborted the world: rank 3 threw: bad input on rank 3"),
              std::string::npos)
        << errs[r];
}

TEST(CommSim, CheckUniform) {
  SimWorld world(4, 5.0);
  const auto errs = world.run([&](Communicator& c) {
    c.check_uniform("test", {"a", "b"}, {7, -(int64_t(1) << 40)});
    c.check_uniform("test", {"a", "b"}, {7, c.rank() == 2 ? 9 : 8});
  });
  for (const auto& e : errs)
    EXPECT_NE(e.find("test: mismatched configuration across ranks: b = 8 on rank 0 but 9 on rank 2"),
              std::string::npos)
        << e;
}

// ---- dispatch planning and payloads ------------------------------------------------------------
// Payloads that encode (source rank, token, slot) land exactly at the documented place: local
// expert l's segment holds rank 0's rows, then rank 1's, ..., each in (token, slot) order, then
// zero padding rows; counts are exchanged right with empty experts and ranks that send nothing.
TEST(Dispatch, PayloadsArriveWhereExpected) {
  for (int n : kWorlds) {
    for (int e_total : {8, 16}) {
      const int k = 3, used = e_total - 3, align = 4;
      const int64_t h = 16;
      const auto in = make_inputs(tokens_for(n, 11 + n), k, e_total, used, h, 100 + n + e_total);
      SimWorld world(n, 10.0);
      const auto errs = world.run([&](Communicator& c) {
        const int me = c.rank(), El = e_total / n;
        const RankInput& ri = in[me];
        // token rows carry (source rank, token) in their first two elements
        std::vector<bf16_t> x(ri.tokens * h);
        for (int64_t t = 0; t < ri.tokens; ++t)
          for (int64_t j = 0; j < h; ++j)
            x[t * h + j] = static_cast<bf16_t>(j == 0 ? me : j == 1 ? t : 1000 + j);
        std::vector<float> probs(ri.tokens * k);
        for (int64_t t = 0; t < ri.tokens; ++t)
          for (int s = 0; s < k; ++s) probs[t * k + s] = encode(me, t, s);
        EpConfig cfg{e_total, k, h, align, WireFormat::kBf16, true};
        const DispatchPlan plan = plan_dispatch(c, cfg, ri.ids.data(), ri.tokens);
        // expected rows, computed from every rank's ids independently of the plan
        std::vector<std::vector<float>> expect(El);
        for (int l = 0; l < El; ++l)
          for (int p = 0; p < n; ++p)
            for (int64_t t = 0; t < in[p].tokens; ++t)
              for (int s = 0; s < k; ++s)
                if (in[p].ids[t * k + s] == me * El + l) expect[l].push_back(encode(p, t, s));
        for (int l = 0; l < El; ++l) {
          ASSERT_EQ(plan.expert_counts[l], static_cast<int32_t>(expect[l].size()));
          for (int p = 0; p < n; ++p) {
            int32_t cnt = 0;
            for (int64_t t = 0; t < in[p].tokens; ++t)
              for (int s = 0; s < k; ++s) cnt += in[p].ids[t * k + s] == me * El + l;
            EXPECT_EQ(plan.recv_counts[p * El + l], cnt);
          }
        }
        if (n >= 2 && me == 1) EXPECT_EQ(plan.send_rows(), 0);
        const int64_t mp = plan.padded_rows();
        std::vector<bf16_t> out(mp * h, 0xABCD);
        std::vector<float> rp(mp, -1.0f);
        ep_dispatch_bf16(c, plan, x.data(), probs.data(), out.data(), rp.data());
        for (int l = 0; l < El; ++l) {
          const int64_t first = plan.padded_offsets[l];
          ASSERT_EQ(plan.padded_offsets[l + 1] - first,
                    (static_cast<int64_t>(expect[l].size()) + align - 1) / align * align);
          for (int64_t i = 0; i < plan.padded_offsets[l + 1] - first; ++i) {
            const int64_t row = first + i;
            if (i < static_cast<int64_t>(expect[l].size())) {
              const int64_t v = static_cast<int64_t>(expect[l][i]);
              EXPECT_EQ(rp[row], expect[l][i]) << "rank " << me << " expert " << l << " row " << i;
              EXPECT_EQ(out[row * h + 0], v / 1048576);
              EXPECT_EQ(out[row * h + 1], (v % 1048576) / 32);
              EXPECT_EQ(out[row * h + 5], 1005);
            } else {
              EXPECT_EQ(rp[row], 0.0f);
              for (int64_t j = 0; j < h; ++j) EXPECT_EQ(out[row * h + j], 0);
            }
          }
        }
      });
      expect_all_ok(errs);
    }
  }
}

// combine_rows sends each padded row back to the exact send row it came from; ep_combine_bf16
// reduces in slot order.
TEST(Dispatch, CombineReturnsRowsInFixedOrder) {
  for (int n : kWorlds) {
    const int e_total = 8, k = 4;
    const int64_t h = 8;
    const auto in = make_inputs(tokens_for(n, 5), k, e_total, e_total, h, 7 + n);
    SimWorld world(n, 10.0);
    const auto errs = world.run([&](Communicator& c) {
      const int me = c.rank();
      const RankInput& ri = in[me];
      const DispatchPlan plan =
          plan_dispatch(c, {e_total, k, h, 16, WireFormat::kBf16, true}, ri.ids.data(), ri.tokens);
      std::vector<float> probs(ri.tokens * k);
      for (int64_t t = 0; t < ri.tokens; ++t)
        for (int s = 0; s < k; ++s) probs[t * k + s] = encode(me, t, s);
      std::vector<bf16_t> rows(plan.padded_rows() * h);
      std::vector<float> rp(plan.padded_rows());
      ep_dispatch_bf16(c, plan, ri.x.data(), probs.data(), rows.data(), rp.data());
      // the expert rank stamps each row with its identity as float bits (hi, lo) and its rank
      std::vector<uint32_t> stamp(plan.padded_rows() * 2);
      for (int64_t r = 0; r < plan.padded_rows(); ++r) {
        stamp[2 * r] = num::f32_bits(rp[r]);
        stamp[2 * r + 1] = static_cast<uint32_t>(me);
      }
      std::vector<uint32_t> back(plan.send_rows() * 2, 0xFFFFFFFFu);
      combine_rows(c, plan, {{stamp.data(), back.data(), 8}});
      const int El = e_total / n;
      for (int64_t t = 0; t < ri.tokens; ++t)
        for (int s = 0; s < k; ++s) {
          const int32_t row = plan.send_routing.row_map[t * k + s];
          if (row < 0) continue;
          EXPECT_EQ(back[2 * row], num::f32_bits(encode(me, t, s)));
          EXPECT_EQ(back[2 * row + 1], static_cast<uint32_t>(ri.ids[t * k + s] / El));
        }
      // combine of the untouched rows with probs: = single-rank unpermute (slot order fma)
      std::vector<bf16_t> y(ri.tokens * h), ref(ri.tokens * h);
      std::vector<float> w(ri.tokens * k, 0.5f);
      ep_combine_bf16(c, plan, rows.data(), w.data(), y.data());
      const cpu::Routing r1 = cpu::build_routing(ri.ids.data(), ri.tokens, k, e_total, 1);
      std::vector<bf16_t> perm(r1.padded_rows() * h);
      if (ri.tokens > 0) {
        cpu::permute_pad_bf16(ri.x.data(), h, r1, perm.data());
        cpu::unpermute_unpad(perm.data(), w.data(), h, r1, ref.data());
      }
      EXPECT_EQ(0, std::memcmp(y.data(), ref.data(), y.size() * sizeof(bf16_t)));
    });
    expect_all_ok(errs);
  }
}

// Forwards to a rank of a SimWorld and counts the messages of its exchanges: dispatch_rows /
// combine_rows must give the same rows whatever the message grouping (direct_bytes), and merging
// must cut the message count.
class CountingComm final : public Communicator {
 public:
  explicit CountingComm(Communicator& c) : c_(c) { set_timeout_s(c.timeout_s()); }
  int rank() const override { return c_.rank(); }
  int world_size() const override { return c_.world_size(); }
  const char* backend() const override { return c_.backend(); }
  MemorySpace memory_space() const override { return c_.memory_space(); }
  void alltoall_i32(const int32_t* s, int32_t* r, int n) override { c_.alltoall_i32(s, r, n); }
  void exchange(const std::vector<P2pOp>& sends, const std::vector<P2pOp>& recvs) override {
    for (const P2pOp& o : sends) {
      EXPECT_NE(o.peer, rank()) << "own chunks must be local copies, not messages";
      ++messages;
    }
    c_.exchange(sends, recvs);
  }
  void copy_local(const std::vector<CopyPiece>& p) override { c_.copy_local(p); }
  void* scratch(int64_t bytes) override { return c_.scratch(bytes); }
  void barrier() override { c_.barrier(); }
  void synchronize() override { c_.synchronize(); }
  std::string error() const override { return c_.error(); }
  void abort(const std::string& reason) override { c_.abort(reason); }
  int64_t messages = 0;

 private:
  Communicator& c_;
};

TEST(Dispatch, MessageGroupingMovesTheSameRows) {
  const int e_total = 16, k = 3;
  for (int n : {2, 4}) {
    // 12 of 16 experts routed, spread by e -> 5e mod 16 so that the 4 empty (peer, expert)
    // chunks fall between non-empty ones, not only at the end
    auto in = make_inputs({37, 0, 29, 41}, k, e_total, 12, 8, 50 + n);
    for (RankInput& ri : in)
      for (int32_t& id : ri.ids)
        if (id >= 0) id = (id * 5) % e_total;
    SimWorld world(n, 10.0);
    const auto errs = world.run([&](Communicator& base) {
      CountingComm c(base);
      const int me = c.rank();
      const RankInput& ri = in[me];
      const DispatchPlan plan =
          plan_dispatch(c, {e_total, k, 8, 8, WireFormat::kBf16, false}, ri.ids.data(), ri.tokens);
      // three streams of odd row sizes: stamp (rank, send row) in every byte pattern
      const int64_t rb[3] = {12, 4, 3};
      std::vector<std::vector<uint8_t>> send(3);
      for (int i = 0; i < 3; ++i) {
        send[i].resize(plan.send_rows() * rb[i]);
        for (int64_t r = 0; r < plan.send_rows(); ++r)
          for (int64_t b = 0; b < rb[i]; ++b) send[i][r * rb[i] + b] = uint8_t(me * 61 + r * 7 + b * 3 + i);
      }
      std::vector<std::vector<uint8_t>> ref;
      int64_t ref_messages = 0;
      // 36 = 3 rows of stream 0: chunks exactly at the threshold travel alone
      for (int64_t direct : {int64_t(0), int64_t(1), int64_t(36), int64_t(40), int64_t(1) << 62}) {
        std::vector<std::vector<uint8_t>> recv(3), back(3);
        std::vector<RowStream> fwd, rev;
        for (int i = 0; i < 3; ++i) {
          recv[i].assign(plan.padded_rows() * rb[i], 0xEE);
          back[i].assign(plan.send_rows() * rb[i], 0xDD);
        }
        for (int i = 0; i < 3; ++i) fwd.push_back({send[i].data(), recv[i].data(), rb[i]});
        for (int i = 0; i < 3; ++i) rev.push_back({recv[i].data(), back[i].data(), rb[i]});
        c.messages = 0;
        dispatch_rows(c, plan, fwd, direct);
        const int64_t msgs = c.messages;
        combine_rows(c, plan, rev, direct);
        for (int i = 0; i < 3; ++i)
          EXPECT_EQ(back[i], send[i]) << "rank " << me << " stream " << i << " direct " << direct;
        // the same combine in chunks of local experts (every rank the same ranges): same rows
        {
          const int El = plan.local_experts;
          std::vector<std::vector<uint8_t>> back2(3);
          std::vector<RowStream> rev2;
          for (int i = 0; i < 3; ++i) back2[i].assign(plan.send_rows() * rb[i], 0xDD);
          for (int i = 0; i < 3; ++i) rev2.push_back({recv[i].data(), back2[i].data(), rb[i]});
          const int cut1 = El / 3, cut2 = (2 * El) / 3;
          combine_rows_experts(c, plan, rev2, 0, cut1, direct);
          combine_rows_experts(c, plan, rev2, cut1, cut2, direct);
          combine_rows_experts(c, plan, rev2, cut2, El, direct);
          for (int i = 0; i < 3; ++i) EXPECT_EQ(back2[i], send[i]) << "chunked combine, rank " << me;
          EXPECT_THROW(combine_rows_experts(c, plan, rev2, 1, 0, direct), Error);
        }
        if (direct == 0) {
          ref = recv;
          ref_messages = msgs;
          // every non-empty (peer, expert) chunk of every stream, other ranks only
          int64_t chunks = 0;
          for (int g = 0; g < e_total; ++g)
            if (g / plan.local_experts != me && plan.send_counts[g] > 0) chunks += 3;
          EXPECT_EQ(msgs, chunks);
        } else {
          EXPECT_EQ(recv, ref) << "rank " << me << " direct " << direct;
        }
        if (direct == (int64_t(1) << 62)) {  // at most one message per peer and stream
          int peers = 0;
          for (int p = 0; p < n; ++p) peers += p != me && plan.rows_to(p) > 0;
          EXPECT_EQ(msgs, 3 * peers);
          EXPECT_LE(msgs, ref_messages);
        }
      }
      // the padding rows were never written
      for (int l = 0; l < plan.local_experts; ++l)
        for (int64_t r = plan.padded_offsets[l] + plan.expert_counts[l]; r < plan.padded_offsets[l + 1]; ++r)
          EXPECT_EQ(ref[0][r * rb[0]], 0xEE);
    });
    expect_all_ok(errs);
  }
}

// The count exchange also carries each rank's tokens per destination rank (the CUDA layer's
// deduplicated dispatch): recv_tokens[p] is what rank p said it sends here; none given: zeros.
TEST(Dispatch, PlanCarriesTokensPerRank) {
  for (int n : kWorlds) {
    SimWorld world(n, 10.0);
    const auto errs = world.run([&](Communicator& c) {
      const int me = c.rank(), E = 2 * n;
      std::vector<int32_t> counts(E, 1), tok(n);
      for (int p = 0; p < n; ++p) tok[p] = (3 * me + p) % (E + 1);  // 0..T tokens to each rank
      const EpConfig cfg{E, 2, 8, 16, WireFormat::kBf16, true};
      const DispatchPlan a = plan_dispatch_counts(c, cfg, counts.data(), E, false, tok.data());
      const DispatchPlan b = plan_dispatch_counts(c, cfg, counts.data(), E, true);
      for (int p = 0; p < n; ++p) {
        EXPECT_EQ(a.send_tokens[p], (3 * me + p) % (E + 1));
        EXPECT_EQ(a.recv_tokens[p], (3 * p + me) % (E + 1));
        EXPECT_EQ(b.send_tokens[p], 0);
        EXPECT_EQ(b.recv_tokens[p], 0);
        for (int l = 0; l < 2; ++l) EXPECT_EQ(a.recv_counts[p * 2 + l], 1);  // the counts still arrive
      }
    });
    expect_all_ok(errs);
  }
  // a token count outside 0..T on one rank: its own error there, a CommError on the others
  SimWorld world(2, 10.0);
  const auto errs = world.run([&](Communicator& c) {
    std::vector<int32_t> counts(4, 1), tok{1, c.rank() == 1 ? 99 : 1};
    plan_dispatch_counts(c, {4, 2, 8, 16, WireFormat::kBf16, true}, counts.data(), 4, false, tok.data());
  });
  EXPECT_NE(errs[1].find("send_tokens[1] = 99; expected 0..4"), std::string::npos) << errs[1];
  EXPECT_NE(errs[0].find("rank 1 rejected its input"), std::string::npos) << errs[0];
}

// plan_from_all_counts (the sync-free CUDA layer's report, made from every rank's counts at once)
// gives every field of the collective plan_dispatch_counts, for random counts, with and without
// token counts; and rejects a rank outside the world.
TEST(Dispatch, PlanFromAllCountsEqualsTheCollectivePlan) {
  for (int n : kWorlds) {
    const int E = 3 * n;
    std::mt19937 rng(77 + n);
    std::vector<int32_t> all(size_t(n) * E), toks(size_t(n) * n);
    for (int32_t& v : all) v = int32_t(rng() % 40);
    for (int32_t& v : toks) v = int32_t(rng() % 9);
    const EpConfig cfg{E, 3, 8, 16, WireFormat::kBf16, true};
    SimWorld world(n, 10.0);
    const auto errs = world.run([&](Communicator& c) {
      const int me = c.rank();
      for (bool with_tokens : {true, false}) {
        const DispatchPlan a = plan_dispatch_counts(c, cfg, all.data() + size_t(me) * E, 2000, true,
                                                    with_tokens ? toks.data() + size_t(me) * n : nullptr);
        const DispatchPlan b = plan_from_all_counts(cfg, me, n, all.data(), 2000, with_tokens ? toks.data() : nullptr);
        EXPECT_EQ(a.describe(), b.describe());
        EXPECT_EQ(a.send_counts, b.send_counts);
        EXPECT_EQ(a.send_offsets, b.send_offsets);
        EXPECT_EQ(a.recv_counts, b.recv_counts);
        EXPECT_EQ(a.expert_counts, b.expert_counts);
        EXPECT_EQ(a.padded_offsets, b.padded_offsets);
        EXPECT_EQ(a.recv_offsets, b.recv_offsets);
        EXPECT_EQ(a.send_tokens, b.send_tokens);
        EXPECT_EQ(a.recv_tokens, b.recv_tokens);
      }
    });
    expect_all_ok(errs);
  }
  std::vector<int32_t> all(8, 1);
  try {
    plan_from_all_counts({4, 2, 8, 16, WireFormat::kBf16, true}, 2, 2, all.data(), 4);
    ADD_FAILURE() << "rank 2 of 2 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2 of 2"), std::string::npos) << e.what();
  }
}

TEST(Dispatch, DirectBytesFromTheSettings) {
  std::map<std::string, std::string> env;
  const SettingLookup lookup = [&](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  EXPECT_EQ(ep_direct_bytes_from_settings(lookup), kEpDirectBytes);
  env["FLOWMOE_EP_DIRECT_BYTES"] = "4096";
  EXPECT_EQ(ep_direct_bytes_from_settings(lookup), 4096);
  env["FLOWMOE_EP_DIRECT_BYTES"] = "-3";
  EXPECT_THROW(ep_direct_bytes_from_settings(lookup), Error);
  env["FLOWMOE_EP_DIRECT_BYTES"] = "12kb";
  EXPECT_THROW(ep_direct_bytes_from_settings(lookup), Error);
}

// A small per-expert linear: out[j] = bf16(Σ_i W_e[j][i] x[i]), FP32 fma in i order.
struct TinyExperts {
  int64_t h;
  std::vector<float> w;  // [E, h, h]
  TinyExperts(int e, int64_t h_, uint32_t seed) : h(h_), w(e * h_ * h_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 0.3f);
    for (auto& v : w) v = nd(rng);
  }
  void operator()(int g, const bf16_t* rows, int64_t n, bf16_t* out) const {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < h; ++j) {
        float acc = 0.f;
        for (int64_t i = 0; i < h; ++i)
          acc = std::fma(w[(g * h + j) * h + i], num::bf16_to_f32(rows[r * h + i]), acc);
        out[r * h + j] = num::f32_to_bf16(acc);
      }
  }
};

// EP = N (dispatch -> local experts -> combine) gives the bits of one rank holding every expert,
// and each rank's dispatched segments equal the single-rank permute+pad segments of its experts.
TEST(Dispatch, ExpertParallelEqualsSingleRankBitForBit) {
  const int e_total = 16, k = 4, align = 8;
  const int64_t h = 32;
  const TinyExperts experts(e_total, h, 99);
  for (int n : kWorlds) {
    const auto in = make_inputs(tokens_for(n, 3 + n), k, e_total, e_total - 2, h, 41 + n);
    const RankInput all = concat(in, h);
    // single rank, built directly from the token.h reference operators
    const cpu::Routing r1 = cpu::build_routing(all.ids.data(), all.tokens, k, e_total, align);
    std::vector<bf16_t> perm(r1.padded_rows() * h), o(r1.padded_rows() * h, 0),
        y1(all.tokens * h);
    cpu::permute_pad_bf16(all.x.data(), h, r1, perm.data());
    for (int g = 0; g < e_total; ++g) {
      const int64_t first = r1.padded_offsets[g];
      experts(g, perm.data() + first * h, r1.counts[g], o.data() + first * h);
    }
    cpu::unpermute_unpad(o.data(), all.probs.data(), h, r1, y1.data());

    std::vector<std::vector<bf16_t>> y(n);
    SimWorld world(n, 10.0);
    const auto errs = world.run([&](Communicator& c) {
      const int me = c.rank(), El = e_total / n;
      const RankInput& ri = in[me];
      const EpConfig cfg{e_total, k, h, align, WireFormat::kBf16};
      y[me].resize(ri.tokens * h);
      ep_reference_forward(c, cfg, ri.x.data(), ri.ids.data(), ri.probs.data(), ri.tokens,
                           std::cref(experts), y[me].data());
      // segments of this rank's experts = the single-rank segments of the same experts
      const DispatchPlan plan = plan_dispatch(c, cfg, ri.ids.data(), ri.tokens);
      std::vector<bf16_t> rows(plan.padded_rows() * h);
      ep_dispatch_bf16(c, plan, ri.x.data(), nullptr, rows.data(), nullptr);
      for (int l = 0; l < El; ++l) {
        const int g = me * El + l;
        const int64_t len = r1.padded_offsets[g + 1] - r1.padded_offsets[g];
        ASSERT_EQ(plan.padded_offsets[l + 1] - plan.padded_offsets[l], len);
        EXPECT_EQ(0, std::memcmp(rows.data() + plan.padded_offsets[l] * h,
                                 perm.data() + r1.padded_offsets[g] * h, len * h * 2))
            << "expert " << g;
      }
    });
    expect_all_ok(errs);
    std::vector<bf16_t> yn;
    for (const auto& v : y) yn.insert(yn.end(), v.begin(), v.end());
    ASSERT_EQ(yn.size(), y1.size());
    EXPECT_EQ(0, std::memcmp(yn.data(), y1.data(), y1.size() * 2)) << "world " << n;
  }
}

// FP8 (codes + 1x128 scales) and MXFP4 (codes + 1x32 scales) payloads land as the single-rank
// permute+pad of the concatenated batch writes them.
TEST(Dispatch, Fp8AndMxfp4PayloadsMatchSingleRankPermutePad) {
  const int e_total = 8, k = 2, align = 16;
  const int64_t h = 256, nc = h / 128, nb = h / 32;
  for (int n : kWorlds) {
    const auto in = make_inputs(tokens_for(n, 17), k, e_total, e_total, h, 5 + n);
    std::mt19937 rng(n);
    std::vector<std::vector<uint8_t>> c8(n), s8(n), c4(n), s4(n);
    for (int r = 0; r < n; ++r) {
      const int64_t t = in[r].tokens;
      c8[r].resize(t * h); s8[r].resize(nc * t); c4[r].resize(t * h / 2); s4[r].resize(t * nb);
      for (auto* v : {&c8[r], &s8[r], &c4[r], &s4[r]})
        for (auto& b : *v) b = static_cast<uint8_t>(rng() % 254 + 1);  // never 0: padding shows
    }
    // single rank
    const RankInput all = concat(in, h);
    const int64_t T = all.tokens;
    std::vector<uint8_t> ac8, as8(nc * T), ac4, as4;
    int64_t t0 = 0;
    for (int r = 0; r < n; ++r) {
      ac8.insert(ac8.end(), c8[r].begin(), c8[r].end());
      ac4.insert(ac4.end(), c4[r].begin(), c4[r].end());
      as4.insert(as4.end(), s4[r].begin(), s4[r].end());
      for (int64_t c = 0; c < nc; ++c)
        for (int64_t t = 0; t < in[r].tokens; ++t) as8[c * T + t0 + t] = s8[r][c * in[r].tokens + t];
      t0 += in[r].tokens;
    }
    const cpu::Routing r1 = cpu::build_routing(all.ids.data(), T, k, e_total, align);
    const int64_t MP = r1.padded_rows();
    std::vector<uint8_t> p8(MP * h), ps8(nc * MP), p4(MP * h / 2), ps4(MP * nb);
    cpu::permute_pad_fp8(ac8.data(), as8.data(), h, r1, p8.data(), ps8.data(), MP);
    cpu::permute_pad_mxfp4(ac4.data(), as4.data(), h, r1, p4.data(), ps4.data());

    SimWorld world(n, 10.0);
    const auto errs = world.run([&](Communicator& c) {
      const int me = c.rank(), El = e_total / n;
      const RankInput& ri = in[me];
      const DispatchPlan f8 =
          plan_dispatch(c, {e_total, k, h, align, WireFormat::kFp8}, ri.ids.data(), ri.tokens);
      const DispatchPlan f4 =
          plan_dispatch(c, {e_total, k, h, align, WireFormat::kMxfp4}, ri.ids.data(), ri.tokens);
      const int64_t mp = f8.padded_rows(), ld = mp + 3;
      std::vector<uint8_t> o8(mp * h, 0xEE), os8(nc * ld, 0xEE), o4(mp * h / 2, 0xEE),
          os4(mp * nb, 0xEE);
      ep_dispatch_fp8(c, f8, c8[me].data(), s8[me].data(), nullptr, o8.data(), os8.data(), ld,
                      nullptr);
      ep_dispatch_mxfp4(c, f4, c4[me].data(), s4[me].data(), nullptr, o4.data(), os4.data(),
                        nullptr);
      for (int l = 0; l < El; ++l) {
        const int g = me * El + l;
        const int64_t G = r1.padded_offsets[g], L = f8.padded_offsets[l];
        const int64_t len = r1.padded_offsets[g + 1] - G;
        ASSERT_EQ(f8.padded_offsets[l + 1] - L, len);
        EXPECT_EQ(0, std::memcmp(o8.data() + L * h, p8.data() + G * h, len * h));
        EXPECT_EQ(0, std::memcmp(o4.data() + L * h / 2, p4.data() + G * h / 2, len * h / 2));
        EXPECT_EQ(0, std::memcmp(os4.data() + L * nb, ps4.data() + G * nb, len * nb));
        for (int64_t cc = 0; cc < nc; ++cc)
          EXPECT_EQ(0, std::memcmp(os8.data() + cc * ld + L, ps8.data() + cc * MP + G, len));
      }
    });
    expect_all_ok(errs);
  }
}

TEST(Dispatch, MismatchedExpertCountIsDetected) {
  SimWorld world(2, 2.0);
  const auto t0 = Clock::now();
  const auto errs = world.run([&](Communicator& c) {
    const int e = c.rank() == 1 ? 6 : 8;  // rank 1 was configured with a different E
    std::vector<int32_t> ids = {0, 1, 2, 3};
    plan_dispatch(c, {e, 2, 128, 16, WireFormat::kFp8}, ids.data(), 2);
  });
  EXPECT_LT(seconds_since(t0), 1.5);  // detected by the protocol, not by the timeout
  for (const auto& e : errs)
    EXPECT_NE(e.find("plan_dispatch: mismatched configuration across ranks: num_experts = 8 on "
                     "rank 0 but 6 on rank 1"),
              std::string::npos)
        << e;
}

TEST(Dispatch, BadInputOnOneRankFailsEveryRank) {
  SimWorld world(4, 30.0);
  const auto t0 = Clock::now();
  const auto errs = world.run([&](Communicator& c) {
    std::vector<int32_t> ids = {0, 1, c.rank() == 2 ? 99 : 2, 3};
    plan_dispatch(c, {8, 2, 128, 16, WireFormat::kBf16}, ids.data(), 2);
  });
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_NE(errs[2].find("expert id 99"), std::string::npos) << errs[2];
  for (int r : {0, 1, 3})
    EXPECT_NE(errs[r].find("rank 2 rejected its input"), std::string::npos) << errs[r];
}

TEST(Dispatch, ConfigErrorsNameTheField) {
  SimWorld world(4, 5.0);
  const auto errs = world.run([&](Communicator& c) {
    std::vector<int32_t> ids = {0};
    plan_dispatch(c, {6, 1, 128, 16, WireFormat::kBf16}, ids.data(), 1);
  });
  for (const auto& e : errs)
    EXPECT_NE(e.find("num_experts E = 6 is not a multiple of the world size 4"), std::string::npos)
        << e;
}

// Bytes on the wire per element and per token, from the formats and as counted by SimWorld.
TEST(Dispatch, WireBytesPerToken) {
  const int64_t H = 7168;  // DeepSeek-V3
  EXPECT_DOUBLE_EQ(wire_bytes_per_element(WireFormat::kBf16, H), 2.0);
  EXPECT_DOUBLE_EQ(wire_bytes_per_element(WireFormat::kFp8, H), 1.0 + 1.0 / 128);  // 1.0078
  EXPECT_DOUBLE_EQ(wire_bytes_per_element(WireFormat::kFp8Fp32Scale, H), 1.03125);
  EXPECT_DOUBLE_EQ(wire_bytes_per_element(WireFormat::kMxfp4, H), 0.53125);
  EXPECT_EQ(wire_row_bytes(WireFormat::kFp8, H), 7168 + 56);
  EXPECT_EQ(wire_row_bytes(WireFormat::kMxfp4, H), 3584 + 224);

  const int n = 4, e_total = 16, k = 4;
  const int64_t h = 256;
  const auto in = make_inputs({12, 9, 0, 20}, k, e_total, e_total, h, 77);
  for (WireFormat f : {WireFormat::kBf16, WireFormat::kFp8, WireFormat::kMxfp4}) {
    SimWorld world(n, 10.0);
    std::vector<int64_t> planned(n);
    std::vector<double> per_token(n);
    const auto errs = world.run([&](Communicator& c) {
      const int me = c.rank();
      const RankInput& ri = in[me];
      const DispatchPlan p = plan_dispatch(c, {e_total, k, h, 16, f, true}, ri.ids.data(), ri.tokens);
      const int64_t mp = p.padded_rows();
      std::vector<uint8_t> codes(ri.tokens * h, 1), scales(ri.tokens * h / 32, 1), o(mp * h * 2),
          os((h / 32) * (mp + 1));
      std::vector<float> rp(mp);
      if (f == WireFormat::kBf16)
        ep_dispatch_bf16(c, p, ri.x.data(), ri.probs.data(), reinterpret_cast<bf16_t*>(o.data()),
                         rp.data());
      else if (f == WireFormat::kFp8)
        ep_dispatch_fp8(c, p, codes.data(), scales.data(), ri.probs.data(), o.data(), os.data(),
                        mp, rp.data());
      else
        ep_dispatch_mxfp4(c, p, codes.data(), scales.data(), ri.probs.data(), o.data(), os.data(),
                          rp.data());
      planned[me] = p.wire_bytes(f, true);
      int64_t remote_rows = 0;
      for (int q = 0; q < n; ++q)
        if (q != me) remote_rows += p.rows_to(q);
      if (remote_rows > 0)
        per_token[me] = static_cast<double>(p.wire_bytes(f, false)) / remote_rows / h;
    });
    expect_all_ok(errs);
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(world.bytes_sent(r), planned[r]) << wire_format_name(f) << " rank " << r;
      if (per_token[r] > 0)
        EXPECT_DOUBLE_EQ(per_token[r], wire_bytes_per_element(f, h)) << wire_format_name(f);
    }
  }
}

// ---- bootstrap ------------------------------------------------------------------------------------
TEST(CommBootstrap, TcpBroadcastFromRoot) {
  const int n = 4;
  const int port = free_port();
  std::vector<uint8_t> id(128);
  for (int i = 0; i < 128; ++i) id[i] = static_cast<uint8_t>(i * 7 + 3);
  std::vector<std::vector<uint8_t>> got(n);
  std::vector<std::string> errs(n);
  std::vector<std::thread> th;
  for (int r = 0; r < n; ++r)
    th.emplace_back([&, r] {
      BootstrapEnv env;
      env.rank = r;
      env.world_size = n;
      env.master_port = port;
      try {
        got[r] = tcp_broadcast_from_root(env, r == 0 ? id : std::vector<uint8_t>(), "fp", 10.0);
      } catch (const std::exception& e) {
        errs[r] = e.what();
      }
    });
  for (auto& t : th) t.join();
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(errs[r], "");
    EXPECT_EQ(got[r], id) << "rank " << r;
  }
}

TEST(CommBootstrap, TcpBroadcastRejectsMismatchAndTimesOut) {
  {
    const int n = 3, port = free_port();
    std::vector<std::string> errs(n);
    std::vector<std::thread> th;
    for (int r = 0; r < n; ++r)
      th.emplace_back([&, r] {
        BootstrapEnv env;
        env.rank = r;
        env.world_size = n;
        env.master_port = port;
        try {
          tcp_broadcast_from_root(env, {1, 2, 3}, r == 2 ? "world=3 nccl=22703" : "world=3 nccl=22809",
                                  10.0);
        } catch (const std::exception& e) {
          errs[r] = e.what();
        }
      });
    for (auto& t : th) t.join();
    for (int r = 0; r < n; ++r)
      EXPECT_NE(errs[r].find("mismatched configuration: rank 2 has \"world=3 nccl=22703\""),
                std::string::npos)
          << "rank " << r << ": " << errs[r];
  }
  {
    BootstrapEnv env;  // rank 0 of 2, and rank 1 never comes
    env.world_size = 2;
    env.master_port = free_port();
    const auto t0 = Clock::now();
    try {
      tcp_broadcast_from_root(env, {1}, "fp", 0.3);
      ADD_FAILURE() << "expected a timeout";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("waiting for rank(s) 1"), std::string::npos) << e.what();
    }
    EXPECT_LT(seconds_since(t0), 5.0);
  }
}

TEST(CommBootstrap, MpiAndSlurmLaunchersGiveRankAndSize) {
  const char* all[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                       "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                       "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "SLURM_PROCID",
                       "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT"};
  for (const char* v : all) unsetenv(v);
  setenv("OMPI_COMM_WORLD_RANK", "5", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "8", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4", 1);
  BootstrapEnv env = bootstrap_env_from_environment();
  EXPECT_EQ(env.launcher, "Open MPI");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  // torchrun's variables win when both are present
  setenv("RANK", "2", 1);
  setenv("WORLD_SIZE", "3", 1);
  env = bootstrap_env_from_environment();
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_EQ(env.rank, 2);
  for (const char* v : all) unsetenv(v);
  setenv("PMI_RANK", "0", 1);
  setenv("PMI_SIZE", "2", 1);
  env = bootstrap_env_from_environment();
  EXPECT_EQ(env.launcher, "MPICH / Intel MPI (PMI)");
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.local_rank, 0);
  for (const char* v : all) unsetenv(v);
  setenv("SLURM_PROCID", "3", 1);
  setenv("SLURM_NTASKS", "4", 1);
  setenv("SLURM_LOCALID", "1", 1);
  env = bootstrap_env_from_environment();
  EXPECT_EQ(env.launcher, "Slurm");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.local_rank, 1);
  setenv("SLURM_PROCID", "4", 1);  // rank >= size
  EXPECT_THROW(bootstrap_env_from_environment(), Error);
  for (const char* v : all) unsetenv(v);
  try {
    bootstrap_env_from_environment();
    FAIL() << "expected an error without any rank variable";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("OMPI_COMM_WORLD_RANK"), std::string::npos) << e.what();
  }
}

TEST(CommBootstrap, EnvironmentAndNvlsGuard) {
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "4", 1);
  unsetenv("LOCAL_RANK");
  setenv("MASTER_ADDR", "10.0.0.1", 1);
  setenv("MASTER_PORT", "1234", 1);
  const BootstrapEnv env = bootstrap_env_from_environment();
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 3);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 1234);
  setenv("RANK", "4", 1);
  EXPECT_THROW(bootstrap_env_from_environment(), Error);
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(v);
  EXPECT_THROW(bootstrap_env_from_environment(), Error);

  const char* old = std::getenv("NCCL_NVLS_ENABLE");
  const std::string saved = old ? old : "";
  unsetenv("NCCL_NVLS_ENABLE");
  ensure_nvls_disabled();
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  setenv("NCCL_NVLS_ENABLE", "1", 1);
  ensure_nvls_disabled();
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  if (old) setenv("NCCL_NVLS_ENABLE", saved.c_str(), 1);
}

TEST(CommBootstrap, LaunchLocalRanks) {
  EXPECT_EQ(0, launch_local_ranks({"/bin/sh", "-c",
                                   "test \"$RANK\" = \"$LOCAL_RANK\" && test \"$RANK\" -lt "
                                   "\"$WORLD_SIZE\" && test \"$WORLD_SIZE\" = 3 && test "
                                   "\"$NCCL_NVLS_ENABLE\" = 0 && test \"$MASTER_PORT\" = 29911 && "
                                   "test \"$MASTER_ADDR\" = 127.0.0.1"},
                                  3, 29911));
  // rank 0 fails at once; the others would sleep 30 s and are stopped after the grace period
  const auto t0 = Clock::now();
  EXPECT_EQ(3, launch_local_ranks({"/bin/sh", "-c", "if [ $RANK = 0 ]; then exit 3; fi; exec sleep 30"},
                                  3, 29912, 0.2));
  EXPECT_LT(seconds_since(t0), 5.0);
}

// The watchdog and per-rank results of launch_local_ranks_ex (flowmoe_nccl_tests and `flowmoe
// launch` rely on them): a rank that hangs is stopped at the timeout; without stop_on_failure a
// failing rank leaves the others running to completion; extra environment reaches every rank.
TEST(CommBootstrap, LaunchWithTimeoutAndPerRankCodes) {
  LaunchOptions opt;
  opt.timeout_s = 0.5;
  auto t0 = Clock::now();
  LaunchResult r = launch_local_ranks_ex(
      {"/bin/sh", "-c", "if [ $RANK = 1 ]; then exec sleep 30; fi; exit 0"}, 2, 29913, opt);
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_TRUE(r.timed_out);
  ASSERT_EQ(r.exit_codes.size(), 2u);
  EXPECT_EQ(r.exit_codes[0], 0);
  EXPECT_EQ(r.exit_codes[1], 128 + 15);  // SIGTERM
  EXPECT_EQ(r.first_failure, 0);  // stopped by the watchdog: timed_out, not a failure of its own
  EXPECT_EQ(r.first_failed_rank, -1);

  LaunchOptions keep;
  keep.stop_on_failure = false;
  keep.grace_s = 0.0;
  keep.timeout_s = 20.0;
  keep.env = {"FLOWMOE_TEST_VAR=hello"};
  t0 = Clock::now();
  r = launch_local_ranks_ex({"/bin/sh", "-c",
                             "test \"$FLOWMOE_TEST_VAR\" = hello || exit 9; "
                             "if [ $RANK = 0 ]; then exit 5; fi; sleep 0.3; exit 0"},
                            2, 29915, keep);
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_codes[0], 5);
  EXPECT_EQ(r.exit_codes[1], 0);  // ran to completion although rank 0 failed
  EXPECT_EQ(r.first_failure, 5);
  EXPECT_EQ(r.first_failed_rank, 0);
  EXPECT_GE(r.seconds[1], 0.25);
  EXPECT_LT(seconds_since(t0), 10.0);
  EXPECT_THROW(launch_local_ranks_ex({"/bin/true"}, 1, 29916, LaunchOptions{10.0, 0.0, true, {"NOEQUALS"}}),
               Error);
}

}  // namespace
}  // namespace flowmoe
