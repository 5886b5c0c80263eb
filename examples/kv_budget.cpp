// kv_budget — how many bytes will my KV cache hold, and how many tokens fit?
//
//   kv_budget --preset deepseek-v2 --context 131072 --compare
//   kv_budget --layers 32 --q-heads 32 --kv-heads 8 --head-dim 128 --bits 8 --json
//   kv_budget --preset llama-3-8b --format int8 --memory 80GiB --weights 16GB
//   kv_budget --preset llama-3-8b --format q4_hadamard --memory 80GiB --weights 16GB
//   kv_budget --preset deepseek-v2 --format fp8_latent --compare
//   kv_budget --preset llama-3.1-70b --memory 80GiB --weights 141GB --tp 4
//
// Every figure comes from kvattn/budget.hpp; this file only reads flags and prints.
#include <kvattn/budget.hpp>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr const char* kUsage = R"(usage: kv_budget MODEL [options]

MODEL is one of:
  --preset NAME                  a published model (see --list-presets)
  --layers L --q-heads H --kv-heads G --head-dim D
                                 an MHA / GQA / MQA model
  --layers L --q-heads H --latent C --rope-dim R [--head-dim D]
                                 an MLA model (D: per-head width used by --compare, default 128)

options:
  --context T     tokens per sequence (default 4096)
  --batch B       sequences (default 1)
  --bits N        bits per cached element, fractions allowed (default 16): a uniform width,
                  for formats the cache may not have
  --format NAME   a KV format of the cache, counted exactly: its values and its scales (per
                  row, per block of 32 values in q4, per block of 128 latent values in
                  fp8_latent and int8_latent), and capacity in pages padded as the cache pads
                  them. Excludes --bits.
                  NAME: {formats}.
                  A design the format cannot hold (MLA in int8, fp8 or q4; MHA, GQA or MQA in
                  fp8_latent or int8_latent; a head_dim not a power of two in int8_hadamard or
                  q4_hadamard, not a multiple of 32 in q4; a latent_dim not a multiple of 128
                  in fp8_latent or int8_latent) shows as n/a
  --compare       the same model as MHA, GQA, MQA and MLA side by side, where the shape allows
  --json          machine-readable: a JSON array, one object per row, exact integer byte counts
  --memory SIZE   memory of one device (e.g. 80GiB, 141GB, 1073741824): plan capacity
  --weights SIZE  model weights sharing that memory, whole model (default 0)
  --tp N          tensor-parallel ranks (default 1)
  --page-size P   tokens per cache page, for the capacity plan (default 16)
  --list-presets  print the presets and exit
  --help          print this and exit
)";

struct BadInput {
  std::string message;
};

[[noreturn]] void fail(const std::string& message) { throw BadInput{message}; }

std::string usage() {
  std::string text = kUsage;
  const std::string_view slot = "{formats}";
  const std::size_t at = text.find(slot);
  // The names wrapped as the text around them is: lines of at most 96 columns, continued under "NAME: ".
  const std::size_t column = at - text.rfind('\n', at) - 1, width = 96;
  const std::string names = kvattn::KvFormat::names();
  std::string wrapped;
  std::size_t used = column;
  for (std::size_t from = 0; from < names.size();) {
    std::size_t to = names.find(' ', from);
    to = to == std::string::npos ? names.size() : to + 1;
    const std::string word = names.substr(from, to - from);
    if (used + word.size() > width && used > column) {
      while (!wrapped.empty() && wrapped.back() == ' ') wrapped.pop_back();
      wrapped += "\n" + std::string(column, ' ');
      used = column;
    }
    wrapped += word;
    used += word.size();
    from = to;
  }
  text.replace(at, slot.size(), wrapped);
  return text;
}

/// `text` as the inside of a JSON string.
std::string json_escaped(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

std::uint64_t parse_count(std::string_view flag, std::string_view text) {
  std::uint64_t v = 0;
  if (text.empty()) fail(std::string(flag) + " needs a number");
  for (char c : text) {
    if (c < '0' || c > '9' || v > (UINT64_MAX - 9) / 10)
      fail(std::string(flag) + " '" + std::string(text) + "': expected a non-negative integer");
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return v;
}

int parse_int(std::string_view flag, std::string_view text) {
  const std::uint64_t v = parse_count(flag, text);
  if (v == 0 || v > 1'000'000) fail(std::string(flag) + " '" + std::string(text) + "': expected an integer from 1 to 1000000");
  return static_cast<int>(v);
}

/// "80GiB", "141GB", "512MiB", "1073741824": bytes.
std::uint64_t parse_size(std::string_view flag, std::string_view text) {
  std::size_t digits = 0;
  while (digits < text.size() && ((text[digits] >= '0' && text[digits] <= '9') || text[digits] == '.')) ++digits;
  const std::string_view number = text.substr(0, digits), unit = text.substr(digits);
  struct Unit {
    std::string_view name;
    std::uint64_t bytes;
  };
  constexpr Unit units[] = {{"", 1},         {"B", 1},
                            {"KiB", 1ull << 10}, {"MiB", 1ull << 20}, {"GiB", 1ull << 30}, {"TiB", 1ull << 40},
                            {"KB", 1000ull},     {"MB", 1000'000ull}, {"GB", 1000'000'000ull}, {"TB", 1000'000'000'000ull}};
  for (const Unit& u : units) {
    if (u.name != unit) continue;
    // Exact decimal arithmetic: value = mantissa / 10^decimals bytes-units.
    std::uint64_t mantissa = 0, scale = 1;
    bool point = false;
    for (char c : number) {
      if (c == '.') {
        if (point) fail(std::string(flag) + " '" + std::string(text) + "': not a size");
        point = true;
        continue;
      }
      mantissa = mantissa * 10 + static_cast<std::uint64_t>(c - '0');
      if (point) scale *= 10;
      if (mantissa > (1ull << 50) || scale > 1'000'000) fail(std::string(flag) + " '" + std::string(text) + "': too large");
    }
    if (number.empty() || number == ".") break;
    return kvattn::detail::checked_mul(mantissa, u.bytes) / scale;
  }
  fail(std::string(flag) + " '" + std::string(text) + "': expected a size such as 80GiB, 141GB or 1073741824");
}

std::string with_commas(std::uint64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<std::size_t>(i), ",");
  return s;
}

/// "2,147,483,648 B (2.00 GiB)"
std::string bytes_text(std::uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, " (%.2f %s)", v, units[u]);
  return with_commas(bytes) + " B" + (u == 0 ? "" : buf);
}

std::string layout_text(const kvattn::Model& m) {
  using kvattn::detail::concat;
  if (m.is_mla()) return concat("latent ", m.mla().latent_dim, " + rope ", m.mla().rope_dim);
  const kvattn::GqaShape& g = m.gqa();
  return concat(g.kv_heads, " KV head", g.kv_heads == 1 ? "" : "s", " x ", g.head_dim);
}

struct Options {
  std::optional<kvattn::Model> model;
  kvattn::Workload workload;
  bool compare = false, json = false;
  std::optional<kvattn::CapacityRequest> capacity;
};

Options parse(int argc, char** argv) {
  Options o;
  std::optional<int> layers, q_heads, kv_heads, head_dim, latent, rope_dim;
  std::string preset;
  kvattn::CapacityRequest cap;
  cap.page_size = 16;
  bool planning = false, capacity_flag = false, bits_flag = false;
  std::optional<kvattn::KvFormat> format;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    const auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) fail(std::string(flag) + " needs a value");
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage().c_str(), stdout);
      std::exit(0);
    } else if (flag == "--list-presets") {
      for (const kvattn::ModelPreset& p : kvattn::presets::all)
        std::printf("%-18s %s, %d layers, %d query heads, %s   (%.*s)\n", std::string(p.model.name).c_str(),
                    std::string(kvattn::to_string(p.model.design())).c_str(), p.model.layers, p.model.q_heads(),
                    layout_text(p.model).c_str(), static_cast<int>(p.source.size()), p.source.data());
      std::exit(0);
    } else if (flag == "--preset") {
      preset = value();
    } else if (flag == "--layers") {
      layers = parse_int(flag, value());
    } else if (flag == "--q-heads") {
      q_heads = parse_int(flag, value());
    } else if (flag == "--kv-heads") {
      kv_heads = parse_int(flag, value());
    } else if (flag == "--head-dim") {
      head_dim = parse_int(flag, value());
    } else if (flag == "--latent") {
      latent = parse_int(flag, value());
    } else if (flag == "--rope-dim") {
      rope_dim = parse_int(flag, value());
    } else if (flag == "--context") {
      o.workload.context = parse_count(flag, value());
    } else if (flag == "--batch") {
      o.workload.batch = parse_count(flag, value());
    } else if (flag == "--bits") {
      o.workload.bits = kvattn::ElementBits::parse(value());
      bits_flag = true;
    } else if (flag == "--format") {
      format = kvattn::KvFormat::parse(value());
    } else if (flag == "--compare") {
      o.compare = true;
    } else if (flag == "--json") {
      o.json = true;
    } else if (flag == "--memory") {
      cap.device_bytes = parse_size(flag, value());
      planning = true;
    } else if (flag == "--weights") {
      cap.weight_bytes = parse_size(flag, value());
      capacity_flag = true;
    } else if (flag == "--tp") {
      cap.tensor_parallel = parse_int(flag, value());
      capacity_flag = true;
    } else if (flag == "--page-size") {
      cap.page_size = parse_int(flag, value());
      capacity_flag = true;
    } else {
      fail("unknown flag '" + std::string(flag) + "'");
    }
  }

  const bool custom = layers || q_heads || kv_heads || head_dim || latent || rope_dim;
  if (!preset.empty() && custom) fail("--preset and a custom shape (--layers, --q-heads, ...) exclude each other");
  if (!preset.empty()) {
    const kvattn::ModelPreset* p = kvattn::presets::find(preset);
    if (!p) fail("no preset called '" + preset + "' (see --list-presets)");
    o.model = p->model;
  } else if (custom) {
    if (!layers || !q_heads) fail("a custom shape needs --layers and --q-heads");
    if (kv_heads && (latent || rope_dim)) fail("--kv-heads (MHA/GQA/MQA) and --latent/--rope-dim (MLA) exclude each other");
    if (latent || rope_dim) {
      if (!latent || !rope_dim) fail("an MLA shape needs both --latent and --rope-dim");
      const int d = head_dim.value_or(128);
      o.model = kvattn::Model{"custom", *layers, kvattn::MlaShape{*q_heads, *latent, *rope_dim, d, d, 0}};
    } else {
      if (!kv_heads || !head_dim) fail("an MHA/GQA/MQA shape needs --kv-heads and --head-dim");
      o.model = kvattn::Model{"custom", *layers, kvattn::GqaShape::gqa(*q_heads, *kv_heads, *head_dim)};
    }
  } else {
    fail("no model: give --preset NAME or a custom shape");
  }
  if (std::string why = o.model->check(); !why.empty()) fail(why);
  if (format && bits_flag) fail("--format and --bits exclude each other: a format has its own width (and scales)");
  if (format) o.workload = kvattn::Workload(o.workload.context, o.workload.batch, *format);
  if (capacity_flag && !planning) fail("--weights, --tp and --page-size plan capacity and need --memory");
  if (planning) {
    cap.context = o.workload.context;
    cap.bits = o.workload.bits;
    cap.format = o.workload.format;
    o.capacity = cap;
  }
  return o;
}

struct Row {
  kvattn::Model model;
  bool own = false;
  std::string format_error;  ///< why the format cannot hold this design: the row is n/a
  kvattn::Footprint footprint;
  std::optional<kvattn::CapacityPlan> plan;
  std::string plan_error;
};

/// "16 bits per element", "int8 format (8-bit values, a 4-byte scale per row)",
/// "q4 format (4-bit values, a 4-byte scale and minimum per block of 32 values)",
/// "fp8_latent format (MLA rows: 8-bit latent values, a 4-byte scale per block of 128 of them,
/// a 16-bit rotary key)"
std::string width_text(const kvattn::Workload& w) {
  if (!w.format) return w.bits.to_string() + " bits per element";
  const kvattn::KvFormat& f = *w.format;
  if (f.latent_scale())
    return kvattn::detail::concat(f.name(), " format (MLA rows: ", f.bits(), "-bit latent values, a ", f.latent_scale_bytes(),
                                  "-byte scale per block of ", f.latent_block(), " of them, a ", f.rope_bits(), "-bit rotary key)");
  // The cache's block scales are BlockScale: an fp16 scale and an fp16 minimum.
  return kvattn::detail::concat(f.name(), " format (", f.bits(), "-bit values",
                                f.row_scale() ? kvattn::detail::concat(", a ", f.scale_bytes(), "-byte scale per row") : "",
                                f.block_scale() ? kvattn::detail::concat(", a ", f.block_scale_bytes(), "-byte scale and minimum per block of ",
                                                                         f.block(), " values")
                                                : "",
                                f.layer_scale() ? ", one key and one value scale per layer" : "",
                                f.rotated() ? ", rows Hadamard-rotated" : "", ")");
}

void print_json(const Options& o, const std::vector<Row>& rows) {
  std::printf("[\n");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const kvattn::Model& m = r.model;
    const kvattn::Footprint& f = r.footprint;
    std::printf("  {\"model\": \"%s\", \"design\": \"%s\", \"own_design\": %s, \"layers\": %d, \"q_heads\": %d",
                std::string(m.name).c_str(), std::string(kvattn::to_string(m.design())).c_str(),
                r.own ? "true" : "false", m.layers, m.q_heads());
    if (m.is_mla())
      std::printf(", \"latent_dim\": %d, \"rope_dim\": %d", m.mla().latent_dim, m.mla().rope_dim);
    else
      std::printf(", \"kv_heads\": %d, \"head_dim\": %d", m.gqa().kv_heads, m.gqa().head_dim);
    if (o.workload.format)
      std::printf(", \"format\": \"%s\", \"scale_bytes_per_row\": %d, \"block\": %d, \"scale_bytes_per_block\": %d"
                  ", \"latent_block\": %d, \"scale_bytes_per_latent_block\": %d, \"rope_bits\": %d",
                  std::string(o.workload.format->name()).c_str(), o.workload.format->scale_bytes(),
                  o.workload.format->block(), o.workload.format->block_scale_bytes(), o.workload.format->latent_block(),
                  o.workload.format->latent_scale_bytes(), o.workload.format->rope_bits());
    else
      std::printf(", \"format\": null");
    std::printf(", \"bits\": %s, \"context\": %" PRIu64 ", \"batch\": %" PRIu64, o.workload.bits.to_string().c_str(),
                o.workload.context, o.workload.batch);
    if (!r.format_error.empty()) {
      std::printf(", \"format_error\": \"%s\"}%s\n", json_escaped(r.format_error).c_str(), i + 1 < rows.size() ? "," : "");
      continue;
    }
    std::printf(", \"elements_per_token_layer\": %" PRIu64 ", \"elements_per_token\": %" PRIu64
                ", \"bytes_per_token_layer\": %" PRIu64 ", \"bytes_per_token\": %" PRIu64
                ", \"bytes_per_sequence\": %" PRIu64 ", \"bytes_per_batch\": %" PRIu64,
                f.elements_per_token_layer, f.elements_per_token, f.bytes_per_token_layer, f.bytes_per_token,
                f.bytes_per_sequence, f.bytes_per_batch);
    if (r.plan) {
      const kvattn::CapacityPlan& p = *r.plan;
      std::printf(", \"tensor_parallel\": %d, \"kv_heads_per_rank\": %d, \"replication\": %d"
                  ", \"cache_bytes_per_rank\": %" PRIu64 ", \"bytes_per_token_per_rank\": %" PRIu64
                  ", \"bytes_per_token_all_ranks\": %" PRIu64 ", \"page_size\": %d, \"bytes_per_page_per_rank\": %" PRIu64
                  ", \"pages_fit\": %" PRIu64 ", \"tokens_fit\": %" PRIu64 ", \"sequences_fit\": %" PRIu64,
                  p.layout.ranks, p.layout.kv_heads_per_rank, p.layout.replication, p.cache_bytes_per_rank,
                  p.bytes_per_token_per_rank, p.bytes_per_token_all_ranks, o.capacity->page_size,
                  p.bytes_per_page_per_rank, p.pages, p.tokens, p.sequences);
    } else if (!r.plan_error.empty()) {
      std::printf(", \"capacity_error\": \"%s\"", json_escaped(r.plan_error).c_str());
    }
    std::printf("}%s\n", i + 1 < rows.size() ? "," : "");
  }
  std::printf("]\n");
}

void print_table(const Options& o, const std::vector<Row>& rows) {
  const kvattn::Model& own = rows.front().own ? rows.front().model : *o.model;
  std::printf("%s: %s, %d layers, %d query heads, %s; %s tokens x %s sequence%s, %s\n\n",
              std::string(own.name).c_str(), std::string(kvattn::to_string(o.model->design())).c_str(),
              own.layers, own.q_heads(), layout_text(*o.model).c_str(), with_commas(o.workload.context).c_str(),
              with_commas(o.workload.batch).c_str(), o.workload.batch == 1 ? "" : "s", width_text(o.workload).c_str());
  std::uint64_t own_bytes = 0;
  for (const Row& r : rows)
    if (r.own && r.format_error.empty()) own_bytes = r.footprint.bytes_per_token;
  std::printf("%-6s %-20s %12s  %-24s %-26s %-32s %-32s%s\n", "design", "cached per layer", "elem/tok/lay",
              "per token per layer", "per token", "per sequence", "per batch", rows.size() > 1 && own_bytes ? " vs own" : "");
  for (const Row& r : rows) {
    if (!r.format_error.empty()) {
      std::printf("%-6s %-20s %12s  n/a: %s%s\n", std::string(kvattn::to_string(r.model.design())).c_str(),
                  layout_text(r.model).c_str(), with_commas(r.footprint.elements_per_token_layer).c_str(),
                  r.format_error.c_str(), r.own ? "  (own)" : "");
      continue;
    }
    const kvattn::Footprint& f = r.footprint;
    char ratio[32] = "";
    if (rows.size() > 1 && own_bytes) std::snprintf(ratio, sizeof ratio, " %7.2fx", static_cast<double>(f.bytes_per_token) / own_bytes);
    std::printf("%-6s %-20s %12s  %-24s %-26s %-32s %-32s%s%s\n",
                std::string(kvattn::to_string(r.model.design())).c_str(), layout_text(r.model).c_str(),
                with_commas(f.elements_per_token_layer).c_str(), bytes_text(f.bytes_per_token_layer).c_str(),
                bytes_text(f.bytes_per_token).c_str(), bytes_text(f.bytes_per_sequence).c_str(),
                bytes_text(f.bytes_per_batch).c_str(), ratio, r.own ? "  (own)" : "");
  }
  if (!o.capacity) return;
  const kvattn::CapacityRequest& c = *o.capacity;
  std::printf("\ncapacity: %s per device, %s of weights over %d rank%s, pages of %d token%s\n",
              bytes_text(c.device_bytes).c_str(), bytes_text(c.weight_bytes).c_str(), c.tensor_parallel,
              c.tensor_parallel == 1 ? "" : "s", c.page_size, c.page_size == 1 ? "" : "s");
  for (const Row& r : rows) {
    const char* design = kvattn::to_string(r.model.design()).data();
    if (!r.plan) {
      std::printf("%-6s %s\n", design, r.format_error.empty() ? r.plan_error.c_str() : "n/a");
      continue;
    }
    const kvattn::CapacityPlan& p = *r.plan;
    const std::string held = r.model.is_mla()
        ? kvattn::detail::concat("the latent and rotary key held by each of ", p.layout.replication, " rank",
                                 p.layout.replication == 1 ? "" : "s")
        : kvattn::detail::concat(p.layout.kv_heads_per_rank, " KV head", p.layout.kv_heads_per_rank == 1 ? "" : "s",
                                 " per rank, each held by ", p.layout.replication, " rank",
                                 p.layout.replication == 1 ? "" : "s");
    std::printf("%-6s %s; %s per token per rank; %s per page per rank%s; %s tokens fit, %s sequences of %s\n", design,
                held.c_str(), bytes_text(p.bytes_per_token_per_rank).c_str(), bytes_text(p.bytes_per_page_per_rank).c_str(),
                c.format ? " (padding included)" : "", with_commas(p.tokens).c_str(), with_commas(p.sequences).c_str(),
                with_commas(c.context).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    std::vector<kvattn::Model> models = o.compare ? kvattn::compare_designs(*o.model) : std::vector<kvattn::Model>{*o.model};
    std::vector<Row> rows;
    for (const kvattn::Model& m : models) {
      Row r{m, m.design() == o.model->design(), o.workload.format ? o.workload.format->check(m) : std::string{}, {}, std::nullopt, {}};
      if (!r.format_error.empty()) {  // a design the format cannot hold: shown as n/a
        r.footprint.elements_per_token_layer = kvattn::elements_per_token_layer(m.attention);
        rows.push_back(r);
        continue;
      }
      r.footprint = kvattn::footprint(m, o.workload);
      if (o.capacity) {
        try {
          r.plan = kvattn::plan_capacity(m, *o.capacity);
        } catch (const std::exception& e) {  // one design may not split across the ranks; the others still print
          r.plan_error = e.what();
        }
      }
      rows.push_back(r);
    }
    // Without --compare the one row is the model; with it, at least one design must be held.
    bool held = false;
    for (const Row& r : rows) held = held || r.format_error.empty();
    if (!held) fail(rows.front().format_error);
    if (o.json)
      print_json(o, rows);
    else
      print_table(o, rows);
    return 0;
  } catch (const BadInput& e) {
    std::fprintf(stderr, "kv_budget: %s\n\n%s", e.message.c_str(), usage().c_str());
  } catch (const kvattn::invalid_argument& e) {
    std::fprintf(stderr, "kv_budget: %s\n\n%s", e.what(), usage().c_str());
  }
  return 2;
}
