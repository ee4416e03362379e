// Comm and Trace under mpirun: every case works for any world size 1..4 (odd included), and
// every expected value is computed here, independently of the code under test.
//
// Self-messages: with one rank, "send to the right neighbour" is a send to oneself, which a
// blocking (s)send cannot do before its receive is posted; those cases use the non-blocking
// pair irecv + isend + wait instead, as comm.h documents.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "common/core/check.h"
#include "common/comm/comm.h"
#include "common/core/tensor.h"
#include "common/lesson/trace.h"

using namespace ff;

// A broken test ends as a watchdog line within this many seconds, never as a hang.
static constexpr double kTestTimeout = 30;

static Comm test_comm() {
  Comm c = Comm::world(nullptr, nullptr);
  c.set_timeout(kTestTimeout);
  return c;
}

// The message rank `src` sends in the ring tests: 3 + src ints, so sizes differ per rank.
static std::vector<int> ring_payload(int src) {
  std::vector<int> v(3 + src);
  for (size_t i = 0; i < v.size(); i++) v[i] = 1000 * src + (int)i;
  return v;
}

static size_t bytes_of(const std::vector<int>& v) { return v.size() * sizeof(int); }

// ----------------------------------------------------------------------------
// point-to-point

TEST_CASE("send/recv ring: rank r sends to r+1 and receives from r-1") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size(), right = (r + 1) % P, left = (r + P - 1) % P;
  std::vector<int> out = ring_payload(r), in(ring_payload(left).size(), -1);
  if (P == 1) {
    Request rr = c.irecv(in.data(), bytes_of(in), left, 5);
    Request sr = c.isend(out.data(), bytes_of(out), right, 5);
    c.wait(rr);
    c.wait(sr);
  } else if (r % 2 == 0) {
    c.send(out.data(), bytes_of(out), right, 5);
    c.recv(in.data(), bytes_of(in), left, 5);
  } else {
    c.recv(in.data(), bytes_of(in), left, 5);
    c.send(out.data(), bytes_of(out), right, 5);
  }
  CHECK(in == ring_payload(left));
}

TEST_CASE("ssend ring: even ranks send first, odd ranks receive first (no deadlock)") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size(), right = (r + 1) % P, left = (r + P - 1) % P;
  std::vector<int> out = ring_payload(r), in(ring_payload(left).size(), -1);
  if (P == 1) {  // a blocking ssend to oneself would deadlock: the synchronous pair instead
    Request rr = c.irecv(in.data(), bytes_of(in), left, 6);
    Request sr = c.issend(out.data(), bytes_of(out), right, 6);
    CHECK(sr.op == "issend");
    c.wait(sr);
    c.wait(rr);
  } else if (r % 2 == 0) {
    c.ssend(out.data(), bytes_of(out), right, 6);
    c.recv(in.data(), bytes_of(in), left, 6);
  } else {
    c.recv(in.data(), bytes_of(in), left, 6);
    c.ssend(out.data(), bytes_of(out), right, 6);
  }
  CHECK(in == ring_payload(left));
}

TEST_CASE("isend/irecv/wait_all: every rank to every rank, itself included") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size();
  // src sends 1 + (src + dst) % 3 values, value i = src*100 + dst*10 + i
  auto message = [](int src, int dst) {
    std::vector<int64_t> v(1 + (src + dst) % 3);
    for (size_t i = 0; i < v.size(); i++) v[i] = src * 100 + dst * 10 + (int64_t)i;
    return v;
  };
  std::vector<std::vector<int64_t>> out(P), in(P);
  std::vector<Request> reqs;
  for (int s = 0; s < P; s++) {
    in[s].assign(message(s, r).size(), -1);
    reqs.push_back(c.irecv(in[s].data(), in[s].size() * sizeof(int64_t), s, 11));
  }
  for (int d = 0; d < P; d++) {
    out[d] = message(r, d);
    reqs.push_back(c.isend(out[d].data(), out[d].size() * sizeof(int64_t), d, 11));
  }
  CHECK(reqs.front().op == "irecv");
  CHECK(reqs.front().peer == 0);
  CHECK(reqs.back().op == "isend");
  CHECK(reqs.back().peer == P - 1);
  CHECK(reqs.back().bytes == message(r, P - 1).size() * sizeof(int64_t));
  c.wait_all(reqs);
  for (int s = 0; s < P; s++) CHECK(in[s] == message(s, r));
  for (const Request& q : reqs) CHECK(q.req == MPI_REQUEST_NULL);
  c.wait(reqs.front());  // waiting again on a completed request returns at once
}

TEST_CASE("sendrecv ring: shift right by one, then left by two") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size();
  for (int shift : {1, -2}) {
    const int dest = ((r + shift) % P + P) % P, src = ((r - shift) % P + P) % P;
    std::vector<int> out = ring_payload(r), in(ring_payload(src).size(), -1);
    c.sendrecv(out.data(), bytes_of(out), dest, 7, in.data(), bytes_of(in), src, 7);
    CHECK(in == ring_payload(src));
  }
}

TEST_CASE("recv: a message shorter than the buffer is an ff::Error, not stale data") {
  Comm c = test_comm();
  const int r = c.rank();
  std::vector<float> out{1.f, 2.f, 3.f, 4.f};
  Request sr = c.isend(out.data(), out.size() * sizeof(float), r, 12);  // to oneself
  Tensor t = Tensor::zeros({8});                                         // expects 8 floats
  CHECK_THROWS_AS(c.recv(t, r, 12), Error);
  c.wait(sr);
}

TEST_CASE("byte counts above INT_MAX are refused with ff::Error before any MPI call") {
  Comm c = test_comm();
  char byte = 0;
  const size_t too_many = (size_t)INT_MAX + 1;
  CHECK_THROWS_AS(c.send(&byte, too_many, c.rank(), 0), Error);
  CHECK_THROWS_AS(c.irecv(&byte, too_many, c.rank(), 0), Error);
  CHECK_THROWS_AS(c.bcast(&byte, too_many, 0), Error);
  c.barrier();  // still in step with each other
}

// ----------------------------------------------------------------------------
// collectives

TEST_CASE("allreduce: built-in sum and max, ints, floats and doubles") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size();
  std::vector<int> vi(5);
  for (int i = 0; i < 5; i++) vi[i] = (r + 1) * (i + 1);
  c.allreduce(vi.data(), 5, MPI_INT, MPI_SUM);
  for (int i = 0; i < 5; i++) CHECK(vi[i] == P * (P + 1) / 2 * (i + 1));

  std::vector<float> vf(4);
  for (int i = 0; i < 4; i++) vf[i] = (float)r + 0.5f * (float)i;  // exact in float32
  c.allreduce_sum(vf.data(), vf.size());
  for (int i = 0; i < 4; i++) CHECK(vf[i] == (float)(P * (P - 1) / 2) + 0.5f * (float)(i * P));

  double vd[2] = {1.5 * r, -1.0 * r};
  c.allreduce(vd, 2, MPI_DOUBLE, MPI_MAX);
  CHECK(vd[0] == 1.5 * (P - 1));
  CHECK(vd[1] == 0.0);
}

// 2x2 integer matrices under multiplication: associative but not commutative, so MPI must
// combine them in rank order: the result is M_0 M_1 ... M_{P-1} on every rank.
struct Mat2 {
  int64_t a, b, c, d;  // [[a, b], [c, d]]
};
static Mat2 mul(const Mat2& x, const Mat2& y) {
  return {x.a * y.a + x.b * y.c, x.a * y.b + x.b * y.d, x.c * y.a + x.d * y.c,
          x.c * y.b + x.d * y.d};
}
// MPI calls fn(in, inout): inout[i] = in[i] op inout[i], `in` coming from the lower ranks.
static void mat2_product(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* x = static_cast<Mat2*>(in);
  auto* y = static_cast<Mat2*>(inout);
  for (int i = 0; i < *len; i++) y[i] = mul(x[i], y[i]);
}
static Mat2 rank_matrix(int r, int j) { return {r + 1 + j, 1, 1, 0}; }

TEST_CASE("allreduce: a user-defined non-commutative op (2x2 matrix product in rank order)") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size();
  MPI_Datatype mat_type;
  MPI_Op op;
  mpiCheck(MPI_Type_contiguous(4, MPI_INT64_T, &mat_type));
  mpiCheck(MPI_Type_commit(&mat_type));
  mpiCheck(MPI_Op_create(mat2_product, /*commute=*/0, &op));
  std::vector<Mat2> v{rank_matrix(r, 0), rank_matrix(r, 1), rank_matrix(r, 2)};
  c.allreduce(v.data(), (int)v.size(), mat_type, op);
  for (int j = 0; j < 3; j++) {
    Mat2 want = rank_matrix(0, j);
    for (int q = 1; q < P; q++) want = mul(want, rank_matrix(q, j));
    CHECK(v[j].a == want.a);
    CHECK(v[j].b == want.b);
    CHECK(v[j].c == want.c);
    CHECK(v[j].d == want.d);
  }
  MPI_Op_free(&op);
  MPI_Type_free(&mat_type);
}

TEST_CASE("allgather: rank r's block at r * bytes, also in place") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size();
  int mine[3] = {10 * r, 10 * r + 1, 10 * r + 2};
  std::vector<int> all(3 * P, -1), want(3 * P);
  for (int q = 0; q < P; q++)
    for (int i = 0; i < 3; i++) want[3 * q + i] = 10 * q + i;
  c.allgather(mine, sizeof mine, all.data());
  CHECK(all == want);

  std::vector<int> inplace(3 * P, -1);
  std::copy(mine, mine + 3, inplace.begin() + 3 * r);
  c.allgather(inplace.data() + 3 * r, sizeof mine, inplace.data());
  CHECK(inplace == want);
}

TEST_CASE("allgatherv: uneven blocks, rank r gives 2r+1 values") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size();
  auto block = [](int q) {
    std::vector<int> v(2 * q + 1);
    for (size_t i = 0; i < v.size(); i++) v[i] = 100 * q + (int)i;
    return v;
  };
  std::vector<size_t> sizes;
  std::vector<int> want;
  for (int q = 0; q < P; q++) {
    sizes.push_back(block(q).size() * sizeof(int));
    for (int x : block(q)) want.push_back(x);
  }
  std::vector<int> mine = block(r), all(want.size(), -1);
  c.allgatherv(mine.data(), bytes_of(mine), all.data(), sizes);
  CHECK(all == want);
}

TEST_CASE("reduce_scatter_sum: rank r gets r+1 values of the sum") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size();
  std::vector<int> counts(P);
  int total = 0, offset = 0;
  for (int q = 0; q < P; q++) {
    counts[q] = q + 1;
    if (q < r) offset += counts[q];
    total += counts[q];
  }
  std::vector<float> send(total);
  for (int i = 0; i < total; i++) send[i] = (float)((r + 1) * (i + 1));
  std::vector<float> recv(counts[r], -1.f);
  c.reduce_scatter_sum(send.data(), recv.data(), counts);
  for (int i = 0; i < counts[r]; i++)
    CHECK(recv[i] == (float)(P * (P + 1) / 2 * (offset + i + 1)));
}

TEST_CASE("bcast: from the last rank") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size();
  std::vector<int> v(6, -1), want(6);
  for (int i = 0; i < 6; i++) want[i] = 7 * i + P;
  if (r == P - 1) v = want;
  c.bcast(v.data(), bytes_of(v), P - 1);
  CHECK(v == want);
}

TEST_CASE("barrier: nobody leaves before the last rank arrives") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size();
  const double late_s = 0.2;  // rank 0 arrives this late
  c.barrier();                // everyone starts together (to within scheduling skew)
  if (r == 0) std::this_thread::sleep_for(std::chrono::duration<double>(late_s));
  const double t0 = MPI_Wtime();
  c.barrier();
  const double waited = MPI_Wtime() - t0;
  if (r != 0 && P > 1) CHECK(waited > late_s / 2);
}

TEST_CASE("alltoallv: different sizes per peer (zero included), exact contents") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size();
  auto count = [](int src, int dst) { return (src + 2 * dst + 1) % 4; };  // 0..3 values
  auto value = [](int src, int dst, int i) { return 10000 * src + 100 * dst + i; };
  std::vector<int> send, want;
  std::vector<size_t> send_bytes(P), recv_bytes(P);
  for (int d = 0; d < P; d++) {
    send_bytes[d] = count(r, d) * sizeof(int);
    for (int i = 0; i < count(r, d); i++) send.push_back(value(r, d, i));
  }
  for (int s = 0; s < P; s++) {
    recv_bytes[s] = count(s, r) * sizeof(int);
    for (int i = 0; i < count(s, r); i++) want.push_back(value(s, r, i));
  }
  std::vector<int> recv(want.size(), -1);
  c.alltoallv(send.data(), send_bytes, recv.data(), recv_bytes);
  CHECK(recv == want);
}

TEST_CASE("split: even and odd ranks, ordered by descending key, then allreduce inside") {
  Comm c = test_comm();
  c.set_timeout(17.5);
  const int r = c.rank(), P = c.size();
  Comm sub = c.split(/*color=*/r % 2, /*key=*/-r);
  std::vector<int> members;  // world ranks of my group, in the new rank order (descending)
  for (int q = P - 1; q >= 0; q--)
    if (q % 2 == r % 2) members.push_back(q);
  CHECK(sub.size() == (int)members.size());
  CHECK(sub.rank() == (int)(std::find(members.begin(), members.end(), r) - members.begin()));
  CHECK(sub.timeout() == 17.5);

  int sum = r;
  sub.allreduce(&sum, 1, MPI_INT, MPI_SUM);
  int want = 0;
  for (int q : members) want += q;
  CHECK(sum == want);

  std::vector<int> order(sub.size(), -1);
  sub.allgather(&r, sizeof r, order.data());
  CHECK(order == members);
}

// ----------------------------------------------------------------------------
// tensors

TEST_CASE("tensor overloads: ring send/recv and ssend, allreduce_sum, bcast, refusals") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size(), right = (r + 1) % P, left = (r + P - 1) % P;
  auto ring_tensor = [](int src) {
    std::vector<float> v(6);
    for (int i = 0; i < 6; i++) v[i] = (float)(src * 10 + i);
    return Tensor::from_vector(v, {2, 3});
  };
  if (P > 1) {  // (a blocking send to oneself is not something to rely on; see the top)
    Tensor in = Tensor::zeros({2, 3});
    if (r % 2 == 0) {
      c.send(ring_tensor(r), right, 21);
      c.recv(in, left, 21);
    } else {
      c.recv(in, left, 21);
      c.send(ring_tensor(r), right, 21);
    }
    CHECK(bitwise_equal(in, ring_tensor(left)));

    Tensor in2 = Tensor::zeros({2, 3});
    if (r % 2 == 0) {
      c.ssend(ring_tensor(r), right, 22);
      c.recv(in2, left, 22);
    } else {
      c.recv(in2, left, 22);
      c.ssend(ring_tensor(r), right, 22);
    }
    CHECK(bitwise_equal(in2, ring_tensor(left)));
  }

  std::vector<float> v(5);
  for (int i = 0; i < 5; i++) v[i] = (float)(r * 5 + i);
  Tensor t = Tensor::from_vector(v, {5});
  c.allreduce_sum(t);
  std::vector<float> got = t.to_vector();
  for (int i = 0; i < 5; i++) CHECK(got[i] == (float)(5 * P * (P - 1) / 2 + i * P));

  Tensor idx = r == P - 1 ? Tensor::from_indices({3, 1, 4, 1, 5}, {5}) : Tensor::zeros({5}, Device::cpu, DType::i64);
  c.bcast(idx, P - 1);
  CHECK(idx.to_index_vector() == std::vector<int64_t>{3, 1, 4, 1, 5});

  Tensor ints = Tensor::zeros({3}, Device::cpu, DType::i64);
  CHECK_THROWS_AS(c.allreduce_sum(ints), Error);  // float32 only (refused on every rank)
}

TEST_CASE("tensor overloads stage sim tensors through the host") {
  REQUIRE(device_available(Device::sim));  // sim needs only the host compiler: always built
  Comm c = test_comm();
  const int r = c.rank(), P = c.size();
  Tensor t = Tensor::full({4}, (float)(r + 1), Device::sim);
  c.allreduce_sum(t);
  CHECK(t.device() == Device::sim);
  for (float x : t.to_vector()) CHECK(x == (float)(P * (P + 1) / 2));
  Tensor b = r == 0 ? Tensor::full({3}, 2.5f, Device::sim) : Tensor::zeros({3}, Device::sim);
  c.bcast(b, 0);
  for (float x : b.to_vector()) CHECK(x == 2.5f);
  // A ring shift: sim tensor out to r+1, into a sim tensor from r-1 (P = 1 sends to itself).
  if (P > 1) {
    // The raw irecv takes host memory (MPI cannot read a device pointer: on device sim the
    // host may not touch device memory, as on a GPU), then the tensor moves to the device.
    Tensor out = Tensor::full({5}, (float)r, Device::sim), in_host = Tensor::zeros({5});
    Request rq = c.irecv(in_host.raw(), in_host.nbytes(), (r + P - 1) % P, 7);
    c.send(out, (r + 1) % P, 7);
    c.wait(rq);
    Tensor in = in_host.to(Device::sim);
    for (float x : in.to_vector()) CHECK(x == (float)((r + P - 1) % P));
    Tensor got = Tensor::zeros({5}, Device::sim);
    if (r == 0) c.recv(got, P - 1, 8);
    if (r == P - 1) c.send(out, 0, 8);
    if (r == 0) for (float x : got.to_vector()) CHECK(x == (float)(P - 1));
  }
}

// ----------------------------------------------------------------------------
// trace

static int count_spans(const std::vector<Span>& spans, const std::string& name) {
  return (int)std::count_if(spans.begin(), spans.end(), [&](const Span& s) { return s.name == name; });
}
static const Span* find_span(const std::vector<Span>& spans, const std::string& name) {
  for (const Span& s : spans)
    if (s.name == name) return &s;
  return nullptr;
}

TEST_CASE("trace: comm and compute spans, gathered to rank 0, written as JSON and CSV") {
  Comm c = test_comm();
  const int r = c.rank(), P = c.size(), right = (r + 1) % P, left = (r + P - 1) % P;
  Trace& tr = trace();
  tr.enable(c);
  tr.clear();

  float out[4] = {1, 2, 3, 4}, in[4];
  c.sendrecv(out, sizeof out, right, 31, in, sizeof in, left, 31);
  int x[3] = {1, 2, 3};
  c.allreduce(x, 3, MPI_INT, MPI_SUM);
  {
    Trace::Scope s(tr, "work", "compute", 42);
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
  }
  // An irecv's span runs from its post to the end of its wait: here it must cover the
  // sender's 20 ms sleep.
  float late = 0, mine = (float)r;
  Request rr = c.irecv(&late, sizeof late, left, 32);
  c.barrier();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  Request sr = c.isend(&mine, sizeof mine, right, 32);
  c.wait(rr);
  c.wait(sr);
  CHECK(late == (float)left);

  const std::vector<Span>& spans = tr.spans();
  REQUIRE(spans.size() == 6);
  const Span* s = find_span(spans, "sendrecv");
  REQUIRE(s != nullptr);
  CHECK(s->stream == "comm");
  CHECK(s->bytes == 2 * (int64_t)sizeof out);
  CHECK(s->end_us >= s->start_us);
  CHECK(s->start_us >= 0);
  s = find_span(spans, "allreduce");
  REQUIRE(s != nullptr);
  CHECK(s->bytes == 3 * (int64_t)sizeof(int));
  s = find_span(spans, "work");
  REQUIRE(s != nullptr);
  CHECK(s->stream == "compute");
  CHECK(s->bytes == 42);
  CHECK(s->end_us - s->start_us >= 3000 * 0.9);
  s = find_span(spans, "irecv");
  REQUIRE(s != nullptr);
  CHECK(s->bytes == (int64_t)sizeof late);
  if (P > 1) CHECK(s->end_us - s->start_us >= 10000);  // 20 ms minus any barrier skew
  CHECK(count_spans(spans, "isend") == 1);
  CHECK(count_spans(spans, "barrier") == 1);

  // gather: 6 spans from every rank, in rank order, on rank 0 only
  std::vector<std::pair<int, Span>> all = tr.gather(c);
  if (r == 0) {
    REQUIRE(all.size() == (size_t)(6 * P));
    for (int q = 0; q < P; q++) {
      CHECK(all[6 * q].first == q);
      CHECK(all[6 * q].second.name == "sendrecv");
      CHECK(all[6 * q + 2].second.name == "work");
      CHECK(all[6 * q + 2].second.bytes == 42);
    }
  } else {
    CHECK(all.empty());
  }

  // the files: a path rank 0 chooses, one process track per rank
  int pid = (int)getpid();
  c.bcast(&pid, sizeof pid, 0);
  const std::string base = "/tmp/fivefold_mpi_tests_" + std::to_string(pid);
  tr.clear();
  tr.add("a \"quoted\", name", "compute", 1.0, 2.5, 0);
  tr.write_chrome_json(c, base + ".json");
  tr.write_csv(c, base + ".csv");
  if (r == 0) {
    std::ifstream jf(base + ".json"), cf(base + ".csv");
    std::stringstream js, cs;
    js << jf.rdbuf();
    cs << cf.rdbuf();
    const std::string json = js.str(), csv = cs.str();
    for (int q = 0; q < P; q++)
      CHECK(json.find("\"args\": {\"name\": \"rank " + std::to_string(q) + "\"}") != std::string::npos);
    CHECK(json.find("\"name\": \"a \\\"quoted\\\", name\"") != std::string::npos);
    CHECK(json.find("\"ts\": 1.000, \"dur\": 1.500") != std::string::npos);
    std::string want_csv = "rank,name,stream,start_us,end_us,bytes\n";
    for (int q = 0; q < P; q++)
      want_csv += std::to_string(q) + ",\"a \"\"quoted\"\", name\",compute,1.000,2.500,0\n";
    CHECK(csv == want_csv);
    std::remove((base + ".json").c_str());
    std::remove((base + ".csv").c_str());
  }

  // rank 0 cannot write: it throws, the others return normally
  const std::string bad = "/nonexistent-fivefold-dir/trace.json";
  if (r == 0)
    CHECK_THROWS_WITH_AS(tr.write_chrome_json(c, bad),
                         ("cannot write trace file " + bad + ": No such file or directory").c_str(),
                         Error);
  else
    CHECK_NOTHROW(tr.write_chrome_json(c, bad));
  tr.clear();
}
