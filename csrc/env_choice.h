// A tuning or protocol switch read from the environment: one of a fixed list of values, anything else refused with
// the list in the message. Host only, torch-free.
#pragma once

#include <cstdlib>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace ep_comm {

// Index of the environment variable's value in `values` (unset or empty: 0). Callers read it once per process.
inline int env_choice(const char* name, std::initializer_list<const char*> values) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return 0;
  std::string allowed;
  int index = 0;
  for (const char* value : values) {
    if (std::string(v) == value) return index;
    allowed += (index++ ? ", " : "") + std::string(value);
  }
  throw std::invalid_argument(std::string(name) + " must be one of " + allowed + ", not '" + v + "'");
}

}  // namespace ep_comm
