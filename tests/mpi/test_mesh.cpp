// The mesh under mpirun (common/comm/mesh.h): at any world size 1..4, every way of writing the
// world size as tp x cp x dp x pp (and every ep that divides a pipeline stage) is built, and
// each axis communicator is checked against the formula written out here:
//     rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i               (tp fastest)
//     within a stage of S = world / pp ranks, s = rank mod S: ep_i = s mod ep, edp_i = s / ep
#include <doctest/doctest.h>

#include <array>
#include <functional>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/comm/mesh.h"
#include "common/core/check.h"

using namespace ff;

// A broken test ends as a watchdog line within this many seconds, never as a hang.
static constexpr double kMeshTestTimeout = 30;

namespace {

// A rank's coordinates from the formula above, and the formula back.
struct Place {
  int tp, cp, dp, pp, ep, edp;
};
struct Shape {
  int tp, cp, dp, pp, ep;
  int world() const { return tp * cp * dp * pp; }
  int stage() const { return tp * cp * dp; }
};
Place place_of(const Shape& s, int r) {
  const int in_stage = r % s.stage();
  return {r % s.tp, r / s.tp % s.cp, r / (s.tp * s.cp) % s.dp, r / s.stage(), in_stage % s.ep,
          in_stage / s.ep};
}
int dense_rank(const Shape& s, const Place& p) { return ((p.pp * s.dp + p.dp) * s.cp + p.cp) * s.tp + p.tp; }
int expert_rank(const Shape& s, const Place& p) { return p.pp * s.stage() + p.edp * s.ep + p.ep; }

// One axis as the test sees it: its size, a rank's index along it, the world rank at index i
// of a rank's group, and whether two places agree on every other coordinate.
struct AxisSpec {
  MeshAxis axis;
  int size;
  std::function<int(const Place&)> index;
  std::function<int(Place, int)> rank_at;
  std::function<bool(const Place&, const Place&)> same_group;
};

std::vector<AxisSpec> axis_specs(const Shape& s) {
  auto same_dense = [](std::array<bool, 4> free) {  // free: tp, cp, dp, pp may differ
    return [free](const Place& a, const Place& b) {
      return (free[0] || a.tp == b.tp) && (free[1] || a.cp == b.cp) && (free[2] || a.dp == b.dp) &&
             (free[3] || a.pp == b.pp);
    };
  };
  return {
      {MeshAxis::tp, s.tp, [](const Place& p) { return p.tp; },
       [s](Place p, int i) { return p.tp = i, dense_rank(s, p); }, same_dense({true, false, false, false})},
      {MeshAxis::cp, s.cp, [](const Place& p) { return p.cp; },
       [s](Place p, int i) { return p.cp = i, dense_rank(s, p); }, same_dense({false, true, false, false})},
      {MeshAxis::dp, s.dp, [](const Place& p) { return p.dp; },
       [s](Place p, int i) { return p.dp = i, dense_rank(s, p); }, same_dense({false, false, true, false})},
      {MeshAxis::pp, s.pp, [](const Place& p) { return p.pp; },
       [s](Place p, int i) { return p.pp = i, dense_rank(s, p); }, same_dense({false, false, false, true})},
      {MeshAxis::dp_cp, s.dp * s.cp, [s](const Place& p) { return p.dp * s.cp + p.cp; },
       [s](Place p, int i) { return p.dp = i / s.cp, p.cp = i % s.cp, dense_rank(s, p); },
       same_dense({false, true, true, false})},
      {MeshAxis::ep, s.ep, [](const Place& p) { return p.ep; },
       [s](Place p, int i) { return p.ep = i, expert_rank(s, p); },
       [](const Place& a, const Place& b) { return a.pp == b.pp && a.edp == b.edp; }},
      {MeshAxis::edp, s.stage() / s.ep, [](const Place& p) { return p.edp; },
       [s](Place p, int i) { return p.edp = i, expert_rank(s, p); },
       [](const Place& a, const Place& b) { return a.pp == b.pp && a.ep == b.ep; }},
  };
}

// Every (tp, cp, dp, pp) with product P, each with every ep that divides its stage.
std::vector<Shape> every_shape(int P) {
  std::vector<Shape> all;
  for (int tp = 1; tp <= P; tp++)
    for (int cp = 1; cp <= P; cp++)
      for (int dp = 1; dp <= P; dp++)
        for (int pp = 1; pp <= P; pp++) {
          if (tp * cp * dp * pp != P) continue;
          for (int ep = 1; ep <= tp * cp * dp; ep++)
            if (tp * cp * dp % ep == 0) all.push_back({tp, cp, dp, pp, ep});
        }
  return all;
}

std::string shape_name(const Shape& s) {
  return "tp " + std::to_string(s.tp) + " cp " + std::to_string(s.cp) + " dp " + std::to_string(s.dp) +
         " pp " + std::to_string(s.pp) + " ep " + std::to_string(s.ep);
}

}  // namespace

TEST_CASE("mesh: every factorisation of the world, every axis communicator") {
  Comm world = Comm::world(nullptr, nullptr);
  world.set_timeout(kMeshTestTimeout);
  const int P = world.size(), me = world.rank();
  const std::vector<Shape> shapes = every_shape(P);
  // e.g. P = 4: tp4, cp4, dp4, pp4, tp2cp2, tp2dp2, ..., each with ep 1 and its other ep
  CHECK(shapes.size() >= (P == 1 ? 1u : 4u));
  for (const Shape& sh : shapes) {
    CAPTURE(shape_name(sh));
    MeshSizes sizes;
    sizes.tp = sh.tp, sizes.cp = sh.cp, sizes.dp = sh.dp, sizes.pp = sh.pp, sizes.ep = sh.ep;
    Mesh mesh(world, sizes);
    const Place mine = place_of(sh, me);
    CHECK(mesh.rank() == me);
    CHECK(mesh.coords().tp == mine.tp);
    CHECK(mesh.coords().cp == mine.cp);
    CHECK(mesh.coords().dp == mine.dp);
    CHECK(mesh.coords().pp == mine.pp);
    CHECK(mesh.coords().ep == mine.ep);
    CHECK(mesh.coords().edp == mine.edp);
    CHECK(mesh.name() == "DP(" + std::to_string(sh.dp) + ")-PP(" + std::to_string(sh.pp) + ")-CP(" +
                             std::to_string(sh.cp) + ")-TP(" + std::to_string(sh.tp) + ")-EP(" +
                             std::to_string(sh.ep) + ")-Rank(" + std::to_string(me) + ")");

    for (const AxisSpec& ax : axis_specs(sh)) {
      CAPTURE(mesh_axis_name(ax.axis));
      Comm& c = mesh.axis(ax.axis);
      REQUIRE(c.size() == ax.size);
      CHECK(c.rank() == ax.index(mine));  // rank i of the axis comm has coordinate i
      // Every member's world rank, by this axis's communicator.
      std::vector<int> members(c.size(), -1);
      c.allgather(&me, sizeof(int), members.data());
      for (int i = 0; i < c.size(); i++) {
        CAPTURE(i);
        CHECK(members[i] == ax.rank_at(mine, i));
        REQUIRE(members[i] >= 0);
        REQUIRE(members[i] < P);
        const Place theirs = place_of(sh, members[i]);
        CHECK(ax.same_group(theirs, mine));  // the other coordinates are equal
        CHECK(ax.index(theirs) == i);
      }
      // The sum of the world ranks over the axis, against the formula's.
      int sum = me, want = 0;
      c.allreduce(&sum, 1, MPI_INT, MPI_SUM);
      for (int i = 0; i < ax.size; i++) want += ax.rank_at(mine, i);
      CHECK(sum == want);
    }
  }
}

TEST_CASE("mesh: sizes that do not fit the world are refused before any communication") {
  Comm world = Comm::world(nullptr, nullptr);
  world.set_timeout(kMeshTestTimeout);
  const int P = world.size();
  MeshSizes too_many;
  too_many.dp = P + 1;
  try {
    Mesh m(world, too_many);
    FAIL("a mesh of " << P + 1 << " ranks was built on " << P);
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("dp " + std::to_string(P + 1) + " x pp 1 x cp 1 x tp 1 = " +
                                     std::to_string(P + 1) + ", but the world has " +
                                     std::to_string(P)) != std::string::npos);
  }
  MeshSizes bad_ep;
  bad_ep.dp = P;
  bad_ep.ep = P + 1;  // never divides a stage of P ranks
  CHECK_THROWS_AS(Mesh(world, bad_ep), Error);
  // the world is still in step: a collective after the refusals completes on every rank
  int one = 1;
  world.allreduce(&one, 1, MPI_INT, MPI_SUM);
  CHECK(one == P);
}
