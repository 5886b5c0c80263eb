# kvattn::kernels: the compiled kernels (include/kvattn/kernels.hpp, src/kernels/), a static
# library holding src/kernels/isa_kernels.cpp compiled once per instruction set kvattn has code
# for on the target architecture, and the dispatcher that chooses among them at run time.
#
# Each instruction set's object is made self-contained before it joins the library: every symbol
# it defines but its table function becomes local, and its COMDAT groups are dissolved, so the
# inline functions it instantiates (kvattn's containers and plans, the standard library's) are
# its own copies, compiled with its flags, and never chosen by the linker for code that runs
# before the dispatcher has checked the CPU.

# kvattn_kernels_isas(OUT): the instruction sets to compile, each as NAME|FLAGS (';' in FLAGS
# written as ',').
function(kvattn_kernels_isas out)
  set(isas "scalar|-DKVATTN_FORCE_SCALAR=1")
  if(NOT KVATTN_FORCE_SCALAR AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
      # What config.hpp requires of each path (KVATTN_TARGET_HAS_AVX2 / _AVX512), on top of the
      # baseline, and what the dispatcher checks before it calls them.
      set(isas "scalar|-march=x86-64,-DKVATTN_FORCE_SCALAR=1"
               "avx2|-march=x86-64,-mavx2,-mfma,-mf16c"
               "avx512|-march=x86-64,-mavx2,-mfma,-mf16c,-mavx512f,-mavx512bw,-mavx512dq,-mavx512vl")
    elseif(CMAKE_SYSTEM_PROCESSOR MATCHES "^(aarch64|arm64|ARM64)$")
      list(APPEND isas "neon|")
    endif()
  endif()
  set(${out} "${isas}" PARENT_SCOPE)
endfunction()

function(kvattn_add_kernels)
  if(NOT CMAKE_OBJCOPY)
    message(FATAL_ERROR "KVATTN_BUILD_KERNELS needs objcopy (CMAKE_OBJCOPY), to make each instruction set's "
                        "object self-contained; set -DKVATTN_BUILD_KERNELS=OFF to build without the compiled kernels")
  endif()
  kvattn_kernels_isas(isas)
  set(objects "")
  set(have "")
  set(dispatch_flags "")
  foreach(entry IN LISTS isas)
    string(FIND "${entry}" "|" bar)
    string(SUBSTRING "${entry}" 0 ${bar} isa)
    math(EXPR bar "${bar} + 1")
    string(SUBSTRING "${entry}" ${bar} -1 flags)
    string(REPLACE "," ";" flags "${flags}")
    set(unit kvattn_kernels_${isa})
    add_library(${unit} OBJECT "${PROJECT_SOURCE_DIR}/src/kernels/isa_kernels.cpp")
    target_link_libraries(${unit} PRIVATE kvattn)
    target_compile_definitions(${unit} PRIVATE KVATTN_KERNELS_ISA=${isa})
    target_compile_options(${unit} PRIVATE ${flags})
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
      # GCC gives inline variables and static members of templates a binding of its own
      # (STB_GNU_UNIQUE) that objcopy cannot make local; weak ones it can.
      target_compile_options(${unit} PRIVATE -fno-gnu-unique)
    endif()
    set_target_properties(${unit} PROPERTIES POSITION_INDEPENDENT_CODE ON)
    if(NOT PROJECT_IS_TOP_LEVEL)
      set_target_properties(${unit} PROPERTIES EXCLUDE_FROM_ALL ON)
    endif()
    set(local "${CMAKE_CURRENT_BINARY_DIR}/kvattn_kernels_${isa}.o")
    add_custom_command(OUTPUT "${local}"
      COMMAND "${CMAKE_OBJCOPY}" --keep-global-symbol=kvattn_kernels_table_${isa} --remove-section=.group
              "$<TARGET_OBJECTS:${unit}>" "${local}"
      DEPENDS ${unit} "$<TARGET_OBJECTS:${unit}>"
      COMMENT "kvattn::kernels: ${isa}'s object, every symbol but its table local"
      VERBATIM)
    list(APPEND objects "${local}")
    string(TOUPPER "${isa}" upper)
    list(APPEND have ${upper})
  endforeach()
  foreach(isa IN ITEMS AVX2 AVX512 NEON)
    if(isa IN_LIST have)
      list(APPEND dispatch_flags KVATTN_KERNELS_HAVE_${isa}=1)
    else()
      list(APPEND dispatch_flags KVATTN_KERNELS_HAVE_${isa}=0)
    endif()
  endforeach()

  add_library(kvattn_kernels STATIC "${PROJECT_SOURCE_DIR}/src/kernels/dispatch.cpp" ${objects})
  add_library(kvattn::kernels ALIAS kvattn_kernels)
  set_target_properties(kvattn_kernels PROPERTIES EXPORT_NAME kernels POSITION_INDEPENDENT_CODE ON)
  if(NOT PROJECT_IS_TOP_LEVEL)
    set_target_properties(kvattn_kernels PROPERTIES EXCLUDE_FROM_ALL ON)
  endif()
  target_link_libraries(kvattn_kernels PUBLIC kvattn)
  target_compile_definitions(kvattn_kernels PRIVATE ${dispatch_flags})
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$" AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(kvattn_kernels PRIVATE -march=x86-64)  # runs before the CPU is known
  endif()
endfunction()
