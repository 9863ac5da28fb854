// Parsing kairox's command-line values (common/arg.cpp and llama-bench, patch 0005): sizes,
// counts and fractions, each refused with a sentence naming the flag and what it accepts.
// Header-only C++: the tools throw std::invalid_argument, which their parsers print.
#pragma once

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

// a size such as 7GiB, 7G, 512MiB or 1.5GB, or a plain number of bytes (K/M/G/T are binary,
// as llama.cpp's sizes are)
static inline int64_t kx_parse_size(const std::string & text, const char * flag = "--vram-budget") {
    size_t i = 0;
    while (i < text.size() && (std::isdigit((unsigned char) text[i]) || text[i] == '.')) {
        ++i;
    }
    std::string unit = text.substr(i);
    for (char & c : unit) {
        c = (char) std::toupper((unsigned char) c);
    }
    double mult = 0;
    if (unit.empty() || unit == "B")                            { mult = 1; }
    else if (unit == "K" || unit == "KB" || unit == "KIB")      { mult = 1024.0; }
    else if (unit == "M" || unit == "MB" || unit == "MIB")      { mult = 1024.0 * 1024; }
    else if (unit == "G" || unit == "GB" || unit == "GIB")      { mult = 1024.0 * 1024 * 1024; }
    else if (unit == "T" || unit == "TB" || unit == "TIB")      { mult = 1024.0 * 1024 * 1024 * 1024; }
    double v = 0;
    try {
        size_t used = 0;
        v = i > 0 ? std::stod(text.substr(0, i), &used) : -1;
        if (used != i) {
            v = -1;
        }
    } catch (const std::exception &) {
        v = -1;
    }
    if (mult == 0 || !(v > 0) || !std::isfinite(v * mult)) {
        throw std::invalid_argument(std::string(flag) + " must be a size > 0 such as 7GiB or 512MiB, not '" + text + "'");
    }
    return (int64_t) (v * mult);
}

// a count >= 0
static inline int64_t kx_parse_count(const std::string & text, const char * flag) {
    size_t used = 0;
    long long v = -1;
    try {
        v = std::stoll(text, &used);
    } catch (const std::exception &) {
        used = 0;
    }
    if (used == 0 || used != text.size() || v < 0) {
        throw std::invalid_argument(std::string(flag) + " must be a whole number >= 0, not '" + text + "'");
    }
    return (int64_t) v;
}

// a number in [lo, hi] (open at an end whose *_open is true)
static inline double kx_parse_fraction(const std::string & text, const char * flag, double lo, bool lo_open, double hi,
                                       bool hi_open) {
    size_t used = 0;
    double v = NAN;
    try {
        v = std::stod(text, &used);
    } catch (const std::exception &) {
        used = 0;
    }
    const bool ok = used > 0 && used == text.size() && std::isfinite(v) && (lo_open ? v > lo : v >= lo) &&
                    (hi_open ? v < hi : v <= hi);
    if (!ok) {
        char range[96];
        std::snprintf(range, sizeof(range), "%s%g, %g%s", lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]");
        throw std::invalid_argument(std::string(flag) + " must be a number in " + range + ", not '" + text + "'");
    }
    return v;
}
