// Note [Where an op was issued]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A posted op's error raises at the next sync point (Note [The device executor]), long after
// the line that issued it ran. So a posted op keeps where it was issued: the innermost Python
// frame of the issuing thread that is the user's, not torch's nor this package's (nn.Linear's
// forward is torch's; the model's forward that called it is the user's), as a code object and
// its last instruction, turned into "file:line in function" only if the op fails.
//
// Cheap because it must be (every posted op pays it): each code object is classified once and
// kept (a strong reference, never dropped: the site may outlive the frame, and a code object
// is freed only with the function that owns it, rarely in a training loop); at most kKept of
// them, after which new ones are not classified and their ops carry no site. A thread with no
// Python frame (autograd's thread for the device, running backward) gives no site.
#include "neuron.h"

#include <Python.h>
#include <frameobject.h>

#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace neuron {
namespace {

constexpr size_t kKept = 1 << 14;

std::mutex g_lock;  // taken with the GIL held, never the reverse
std::vector<std::string> g_internal_dirs;
std::unordered_map<const PyCodeObject*, bool> g_internal;  // code -> torch's or ours

bool starts_with_any(const std::string& path, const std::vector<std::string>& prefixes) {
  for (const std::string& p : prefixes) {
    if (path.compare(0, p.size(), p) == 0) {
      return true;
    }
  }
  return false;
}

// Whether code is torch's or this package's (nullopt-like -1: not classified, table full).
int internal(PyCodeObject* code) {
  std::lock_guard<std::mutex> guard(g_lock);
  auto found = g_internal.find(code);
  if (found != g_internal.end()) {
    return found->second ? 1 : 0;
  }
  if (g_internal.size() >= kKept) {
    return -1;
  }
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  if (file == nullptr) {
    PyErr_Clear();
    return -1;
  }
  const bool is_internal = starts_with_any(file, g_internal_dirs) || file[0] == '<';  // <frozen ...>, <string> of torch
  Py_INCREF(code);  // kept for ever (Note [Where an op was issued])
  g_internal.emplace(code, is_internal);
  return is_internal ? 1 : 0;
}

}  // namespace

void add_internal_source_dir(std::string dir) {
  std::lock_guard<std::mutex> guard(g_lock);
  g_internal_dirs.push_back(std::move(dir));
  g_internal.clear();  // classified against fewer folders (the codes' references stay: kept)
}

IssueSite issue_site() {
  // No thread state: no Python frame on this thread (and no GIL to take cheaply).
  if (!Py_IsInitialized() || PyGILState_GetThisThreadState() == nullptr) {
    return {};
  }
  IssueSite site;
  const PyGILState_STATE gil = PyGILState_Ensure();
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    const int kind = internal(code);
    if (kind == 0) {
      site.code = code;  // kept by the table
      site.lasti = PyFrame_GetLasti(frame);
    }
    Py_DECREF(code);
    if (kind != 1) {
      Py_DECREF(frame);
      break;
    }
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  PyGILState_Release(gil);
  return site;
}

std::string describe_issue_site(const IssueSite& site) {
  if (site.code == nullptr || !Py_IsInitialized()) {
    return "";
  }
  const PyGILState_STATE gil = PyGILState_Ensure();
  auto* code = static_cast<PyCodeObject*>(const_cast<void*>(site.code));
  std::string where;
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  const char* name = PyUnicode_AsUTF8(code->co_name);
  if (file != nullptr && name != nullptr) {
    where = std::string(file) + ":" + std::to_string(PyCode_Addr2Line(code, site.lasti)) + " in " + name;
  } else {
    PyErr_Clear();
  }
  PyGILState_Release(gil);
  return where;
}

}  // namespace neuron
