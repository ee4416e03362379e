// common/comm/link.cpp — the link model's flag: parse_link ("intra=BW,inter=BW,latency=T")
// and describe (one line for a lesson's output). The model itself, the link state and the
// waits it delays are in comm.cpp.
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/comm/comm.h"

namespace ff {

const char* link_class_name(LinkClass c) {
  return c == LinkClass::self ? "self" : c == LinkClass::intra ? "intra" : "inter";
}

namespace {

struct Unit {
  const char* name;
  double scale;  // to bytes per second, or to seconds
};
const Unit kBandwidthUnits[] = {{"GB/s", 1e9}, {"MB/s", 1e6}, {"KB/s", 1e3}, {"B/s", 1}};
const Unit kTimeUnits[] = {{"s", 1}, {"ms", 1e-3}, {"us", 1e-6}, {"ns", 1e-9}};

// A decimal number at the start of s: digits with an optional fraction and exponent (no sign,
// no hex, no inf or nan). Returns its length, 0 if s does not start with one.
size_t number_length(const std::string& s) {
  size_t i = 0, digits = 0;
  while (i < s.size() && std::isdigit((unsigned char)s[i])) i++, digits++;
  if (i < s.size() && s[i] == '.') {
    i++;
    while (i < s.size() && std::isdigit((unsigned char)s[i])) i++, digits++;
  }
  if (digits == 0) return 0;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    size_t j = i + 1;
    if (j < s.size() && (s[j] == '+' || s[j] == '-')) j++;
    size_t exp_digits = 0;
    while (j < s.size() && std::isdigit((unsigned char)s[j])) j++, exp_digits++;
    if (exp_digits > 0) i = j;  // else the 'e' is left for the unit, which will refuse it
  }
  return i;
}

// value = number * unit, the unit one of `units` or, when absent, `bare`'s scale. False on
// anything else, or when the result is not finite.
bool parse_quantity(const std::string& text, const Unit* units, size_t n_units, double bare,
                    double* value) {
  const size_t len = number_length(text);
  if (len == 0) return false;
  const double x = std::strtod(text.substr(0, len).c_str(), nullptr);
  const std::string unit = text.substr(len);
  double scale = unit.empty() ? bare : 0;
  for (size_t i = 0; i < n_units && scale == 0; i++)
    if (unit == units[i].name) scale = units[i].scale;
  if (scale == 0) return false;
  *value = x * scale;
  return std::isfinite(*value);
}

// x with up to six significant digits and no trailing zeros: "160", "1.5", "0.25".
std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

std::string bandwidth_text(double bytes_per_s) {
  for (const Unit& u : kBandwidthUnits)
    if (bytes_per_s >= u.scale) return num(bytes_per_s / u.scale) + " " + u.name;
  return num(bytes_per_s) + " B/s";
}

std::string time_text(double s) {
  if (s == 0) return "0 us";
  for (const Unit& u : kTimeUnits)
    if (s >= u.scale) return num(s / u.scale) + " " + u.name;
  return num(s / 1e-9) + " ns";
}

}  // namespace

bool parse_link(const std::string& spec, LinkModel* out, std::string* error) {
  auto fail = [&](const std::string& why) {
    if (error) *error = "--link: " + why;
    return false;
  };
  const std::string want = "want intra=BW,inter=BW,latency=T (any of them, each once)";
  if (spec.empty()) return fail("empty; " + want);
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    const size_t comma = spec.find(',', start);
    parts.push_back(spec.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  LinkModel m = *out;
  m.intra_bytes_per_s = LinkModel().intra_bytes_per_s;
  m.inter_bytes_per_s = LinkModel().inter_bytes_per_s;
  m.latency_s = LinkModel().latency_s;
  bool seen_intra = false, seen_inter = false, seen_latency = false;
  for (const std::string& part : parts) {
    if (part.empty()) return fail("empty part in '" + spec + "'; " + want);
    const size_t eq = part.find('=');
    if (eq == std::string::npos)
      return fail("'" + part + "': not key=value; " + want);
    const std::string key = part.substr(0, eq), value = part.substr(eq + 1);
    bool* seen = key == "intra" ? &seen_intra : key == "inter" ? &seen_inter
               : key == "latency" ? &seen_latency : nullptr;
    if (!seen) return fail("'" + part + "': unknown key '" + key + "'; the keys are intra, inter and latency");
    if (*seen) return fail("'" + part + "': " + key + " is given twice; each key at most once");
    *seen = true;
    if (key == "latency") {
      double t = 0;
      if (!parse_quantity(value, kTimeUnits, 4, 1e-6, &t))
        return fail("'" + part + "': latency must be a non-negative number with unit s, ms, us or ns");
      m.latency_s = t;
    } else {
      double bw = 0;
      if (!parse_quantity(value, kBandwidthUnits, 4, 1e9, &bw) || !(bw > 0))
        return fail("'" + part + "': bandwidth must be a positive number with unit GB/s, MB/s, KB/s or B/s");
      (key == "intra" ? m.intra_bytes_per_s : m.inter_bytes_per_s) = bw;
    }
  }
  m.enabled = true;
  *out = m;
  return true;
}

std::string describe(const LinkModel& m) {
  const std::string per_node = std::to_string(m.ranks_per_node) +
                               (m.ranks_per_node == 1 ? " rank per " : " ranks per ") +
                               (m.real_nodes ? "node" : "virtual node");
  if (!m.enabled) return "links not modelled (" + per_node + ")";
  return "modelled links: intra-node " + bandwidth_text(m.intra_bytes_per_s) + ", inter-node " +
         bandwidth_text(m.inter_bytes_per_s) + ", latency " + time_text(m.latency_s) + ", " +
         per_node;
}

}  // namespace ff
