// A stand-in for Apple's metal-cpp, just enough for MLX's Metal headers and
// mlxq's host code (csrc/metal/*.cpp) to *compile* on Linux (-fsyntax-only):
// it checks our calls against MLX's real CommandEncoder / Device API. The
// types are declarations only; nothing here runs.
#pragma once
#include <cstddef>
#include <cstdint>

namespace NS {
using UInteger = unsigned long;
using Integer = long;
enum StringEncoding { UTF8StringEncoding = 4, ASCIIStringEncoding = 1 };
class Object {
 public:
  void release();
  Object* retain();
};
class String : public Object {
 public:
  static String* string(const char*, StringEncoding);
  const char* utf8String() const;
};
class Error : public Object {
 public:
  String* localizedDescription() const;
};
class AutoreleasePool : public Object {};
template <class T>
class SharedPtr {
 public:
  SharedPtr() = default;
  T* get() const;
  T* operator->() const;
  explicit operator bool() const;
};
template <class T>
SharedPtr<T> TransferPtr(T*);
template <class T>
SharedPtr<T> RetainPtr(T*);
} // namespace NS

namespace MTL {
struct Size {
  Size(NS::UInteger w, NS::UInteger h, NS::UInteger d) : width(w), height(h), depth(d) {}
  NS::UInteger width, height, depth;
};
enum DataType { DataTypeNone = 0, DataTypeBool = 53, DataTypeInt = 29, DataTypeFloat = 3 };
enum BarrierScope { BarrierScopeBuffers = 1 };
class Resource : public NS::Object {};
class Allocation : public NS::Object {};
class Buffer : public Resource {
 public:
  void* contents();
  NS::UInteger length() const;
};
class Function : public NS::Object {};
class LinkedFunctions : public NS::Object {};
class Library : public NS::Object {};
class Fence : public NS::Object {};
class ResidencySet : public NS::Object {};
class ComputePipelineState : public NS::Object {
 public:
  NS::UInteger maxTotalThreadsPerThreadgroup() const;
  NS::UInteger threadExecutionWidth() const;
};
class ComputeCommandEncoder : public NS::Object {
 public:
  void setComputePipelineState(const ComputePipelineState*);
  void setBuffer(const Buffer*, NS::UInteger offset, NS::UInteger index);
  void setBytes(const void*, NS::UInteger length, NS::UInteger index);
  void setThreadgroupMemoryLength(NS::UInteger length, NS::UInteger index);
  void dispatchThreadgroups(Size, Size);
  void dispatchThreads(Size, Size);
  void memoryBarrier(BarrierScope);
};
class CommandBuffer : public NS::Object {};
class CommandQueue : public NS::Object {};
class Device : public NS::Object {};
} // namespace MTL
