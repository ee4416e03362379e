// The mesh's layout without MPI (common/comm/mesh.h): the order, coordinates, groups, names
// and the size check. Expected groups are written out by hand (several from the examples in
// Megatron-LM's parallel_state.py docstrings), not computed by the code under test.
#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "common/comm/mesh.h"
#include "common/core/check.h"

using namespace ff;

using Groups = std::vector<std::vector<int>>;

static MeshSizes sizes(int tp, int cp, int dp, int pp, int ep = 1) {
  MeshSizes s;
  s.tp = tp, s.cp = cp, s.dp = dp, s.pp = pp, s.ep = ep;
  return s;
}

// Every (tp, cp, dp, pp) with product P, and every ep that divides P / pp.
static std::vector<MeshSizes> every_mesh(int P) {
  std::vector<MeshSizes> all;
  for (int tp = 1; tp <= P; tp++)
    for (int cp = 1; cp <= P; cp++)
      for (int dp = 1; dp <= P; dp++)
        for (int pp = 1; pp <= P; pp++) {
          if (tp * cp * dp * pp != P) continue;
          for (int ep = 1; ep <= tp * cp * dp; ep++)
            if ((tp * cp * dp) % ep == 0) all.push_back(sizes(tp, cp, dp, pp, ep));
        }
  return all;
}

TEST_CASE("mesh: the order is Megatron's, tp fastest, then cp, then dp, then pp") {
  // tp 2, cp 2, dp 2, pp 2: rank 13 = 8 (pp 1) + 4 (dp 1) + 0 (cp 0) + 1 (tp 1)
  const MeshSizes s = sizes(2, 2, 2, 2);
  MeshCoords c = mesh_coords(s, 13);
  CHECK(c.tp == 1);
  CHECK(c.cp == 0);
  CHECK(c.dp == 1);
  CHECK(c.pp == 1);
  c = mesh_coords(s, 2);  // cp is the second fastest
  CHECK(c.tp == 0);
  CHECK(c.cp == 1);
  CHECK(c.dp == 0);
  CHECK(c.pp == 0);
  MeshCoords want;
  want.tp = 1, want.cp = 1, want.dp = 0, want.pp = 1;
  CHECK(mesh_rank(s, want) == 8 + 2 + 1);
  // tp 3, cp 1, dp 2, pp 2 (world 12): rank 11 is the last of everything
  const MeshSizes t = sizes(3, 1, 2, 2);
  c = mesh_coords(t, 11);
  CHECK(c.tp == 2);
  CHECK(c.dp == 1);
  CHECK(c.pp == 1);
  CHECK(mesh_coords(t, 5).dp == 1);
  CHECK(mesh_coords(t, 5).pp == 0);
  CHECK(mesh_coords(t, 6).pp == 1);
}

TEST_CASE("mesh: rank -> coordinates -> rank round trip, every coordinate in range") {
  for (int P : {1, 2, 3, 4, 6, 8, 12}) {
    for (const MeshSizes& s : every_mesh(P)) {
      CAPTURE(mesh_name(s, 0));
      std::set<std::vector<int>> seen;
      for (int r = 0; r < P; r++) {
        const MeshCoords c = mesh_coords(s, r);
        CHECK(c.tp >= 0);
        CHECK(c.tp < s.tp);
        CHECK(c.cp >= 0);
        CHECK(c.cp < s.cp);
        CHECK(c.dp >= 0);
        CHECK(c.dp < s.dp);
        CHECK(c.pp >= 0);
        CHECK(c.pp < s.pp);
        CHECK(c.ep >= 0);
        CHECK(c.ep < s.ep);
        CHECK(c.edp >= 0);
        CHECK(c.edp < P / (s.pp * s.ep));
        CHECK(mesh_rank(s, c) == r);
        // the formula, written out here
        CHECK(r == ((c.pp * s.dp + c.dp) * s.cp + c.cp) * s.tp + c.tp);
        // EP folding: (pp, edp, ep) is a second numbering of the same ranks
        CHECK(r == (c.pp * (P / (s.pp * s.ep)) + c.edp) * s.ep + c.ep);
        seen.insert({c.tp, c.cp, c.dp, c.pp});
      }
      CHECK(seen.size() == (size_t)P);  // no two ranks share coordinates
    }
  }
}

TEST_CASE("mesh: groups of Megatron's examples") {
  // parallel_state.py: 16 GPUs, tp 2, pp 4 (so dp 2)
  const MeshSizes s = sizes(2, 1, 2, 4);
  CHECK(mesh_groups(s, MeshAxis::dp) ==
        Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  CHECK(mesh_groups(s, MeshAxis::tp) ==
        Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  CHECK(mesh_groups(s, MeshAxis::pp) == Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}});
  // its context-parallel example: 8 GPUs, tp 4, cp 2
  const MeshSizes c = sizes(4, 2, 1, 1);
  CHECK(mesh_groups(c, MeshAxis::cp) == Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(mesh_groups(c, MeshAxis::tp) == Groups{{0, 1, 2, 3}, {4, 5, 6, 7}});
  // dp-cp: tp 2, cp 2, dp 2 (8 ranks): cp faster than dp inside the group
  const MeshSizes d = sizes(2, 2, 2, 1);
  CHECK(mesh_groups(d, MeshAxis::dp_cp) == Groups{{0, 2, 4, 6}, {1, 3, 5, 7}});
  CHECK(mesh_groups(d, MeshAxis::dp) == Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(mesh_groups(d, MeshAxis::cp) == Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
}

TEST_CASE("mesh: EP folded inside each pipeline stage (expert-TP 1, then ep, then expert-DP)") {
  // tp 2, dp 2, pp 2, ep 2: stages [0..3] and [4..7]
  const MeshSizes s = sizes(2, 1, 2, 2, 2);
  CHECK(mesh_groups(s, MeshAxis::ep) == Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(mesh_groups(s, MeshAxis::edp) == Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(mesh_groups(s, MeshAxis::pp) == Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  // ep 4 on the same ranks: one EP group per stage, every expert-DP group a single rank
  const MeshSizes f = sizes(2, 1, 2, 2, 4);
  CHECK(mesh_groups(f, MeshAxis::ep) == Groups{{0, 1, 2, 3}, {4, 5, 6, 7}});
  CHECK(mesh_groups(f, MeshAxis::edp) == Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}});
  // ep 1: every rank holds every expert; expert-DP is the whole stage
  const MeshSizes one = sizes(2, 1, 2, 2, 1);
  CHECK(mesh_groups(one, MeshAxis::ep) == Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}});
  CHECK(mesh_groups(one, MeshAxis::edp) == Groups{{0, 1, 2, 3}, {4, 5, 6, 7}});
  // ep 3 over cp 3 x tp 2 (6 ranks, pp 1): ranks 0 1 2 | 3 4 5
  const MeshSizes odd = sizes(2, 3, 1, 1, 3);
  CHECK(mesh_groups(odd, MeshAxis::ep) == Groups{{0, 1, 2}, {3, 4, 5}});
  CHECK(mesh_groups(odd, MeshAxis::edp) == Groups{{0, 3}, {1, 4}, {2, 5}});
  CHECK(mesh_coords(odd, 4).ep == 1);
  CHECK(mesh_coords(odd, 4).edp == 1);
}

TEST_CASE("mesh: the groups of every axis split the world into equal parts") {
  for (int P : {1, 2, 3, 4, 6, 8}) {
    for (const MeshSizes& s : every_mesh(P)) {
      for (MeshAxis a : kMeshAxes) {
        CAPTURE(mesh_name(s, 0));
        CAPTURE(mesh_axis_name(a));
        const Groups g = mesh_groups(s, a);
        CHECK(g.size() * (size_t)mesh_axis_size(s, a) == (size_t)P);
        std::vector<int> all;
        for (const auto& group : g) {
          CHECK(group.size() == (size_t)mesh_axis_size(s, a));
          for (size_t i = 0; i < group.size(); i++) {
            all.push_back(group[i]);
            if (group[i] < 0 || group[i] >= P) continue;  // caught by the sort check below
            CHECK(mesh_axis_index(s, mesh_coords(s, group[i]), a) == (int)i);
          }
        }
        std::sort(all.begin(), all.end());
        std::vector<int> want(P);
        for (int r = 0; r < P; r++) want[r] = r;
        CHECK(all == want);  // every rank in exactly one group
      }
    }
  }
}

TEST_CASE("mesh: printable name and --print-mesh text") {
  const MeshSizes s = sizes(2, 1, 2, 1);
  CHECK(mesh_name(s, 3) == "DP(2)-PP(1)-CP(1)-TP(2)-EP(1)-Rank(3)");
  CHECK(mesh_name(sizes(1, 2, 1, 2, 2), 0) == "DP(1)-PP(2)-CP(2)-TP(1)-EP(2)-Rank(0)");
  CHECK(mesh_groups_text(s) ==
        "   tp groups: [0 1] [2 3]\n"
        "   cp groups: [0] [1] [2] [3]\n"
        "   dp groups: [0 2] [1 3]\n"
        "   pp groups: [0] [1] [2] [3]\n"
        "dp-cp groups: [0 2] [1 3]\n"
        "   ep groups: [0] [1] [2] [3]\n"
        "  edp groups: [0 1 2 3]\n");
}

TEST_CASE("mesh: check_mesh names the product and the world size, sizes >= 1, the ep rule") {
  CHECK(check_mesh(sizes(2, 1, 2, 1), 4) == "");
  CHECK(check_mesh(sizes(1, 1, 1, 1), 1) == "");
  CHECK(check_mesh(sizes(2, 1, 2, 1), 6) == "dp 2 x pp 1 x cp 1 x tp 2 = 4, but the world has 6 ranks");
  CHECK(check_mesh(sizes(2, 3, 1, 1), 1) == "dp 1 x pp 1 x cp 3 x tp 2 = 6, but the world has 1 rank");
  CHECK(check_mesh(sizes(0, 1, 4, 1), 4) == "tp is 0, but every mesh size must be at least 1");
  CHECK(check_mesh(sizes(1, 1, 4, -1), 4) == "pp is -1, but every mesh size must be at least 1");
  CHECK(check_mesh(sizes(1, 1, 4, 1, 0), 4) == "ep is 0, but every mesh size must be at least 1");
  CHECK(check_mesh(sizes(1, 1, 4, 1, 3), 4) ==
        "ep 3 must divide dp x cp x tp = 4, the ranks of one pipeline stage that the experts are spread over");
  // ep divides the world but not one stage: 4 ranks, pp 2 -> stages of 2
  CHECK(check_mesh(sizes(1, 1, 2, 2, 4), 4) ==
        "ep 4 must divide dp x cp x tp = 2, the ranks of one pipeline stage that the experts are spread over");
  CHECK(check_mesh(sizes(1, 1, 2, 2, 2), 4) == "");
  // sizes whose product overflows an int are still named correctly
  CHECK(check_mesh(sizes(65536, 1, 65536, 1), 4) ==
        "dp 65536 x pp 1 x cp 1 x tp 65536 = 4294967296, but the world has 4 ranks");
  // and the coordinates refuse a bad mesh or a rank outside it
  CHECK_THROWS_AS(mesh_coords(sizes(1, 1, 4, 1, 3), 0), Error);
  CHECK_THROWS_AS(mesh_coords(sizes(2, 1, 2, 1), 4), Error);
}
