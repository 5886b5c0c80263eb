# Builds and runs a tiny project that uses kvattn the way an engine would:
#   MODE=find_package      against a copy of kvattn installed from this build tree;
#   MODE=add_subdirectory  against kvattn's source tree.
# Invoked by CTest with KVATTN_SOURCE_DIR, KVATTN_BINARY_DIR, MODE, WORK_DIR, GENERATOR, CXX.
cmake_minimum_required(VERSION 3.21)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE code)
  if(NOT code EQUAL 0)
    string(REPLACE ";" " " shown "${ARGN}")
    message(FATAL_ERROR "failed (${code}): ${shown}")
  endif()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(consumer_args -G "${GENERATOR}" -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release)
if(MODE STREQUAL "find_package")
  run("${CMAKE_COMMAND}" --install "${KVATTN_BINARY_DIR}" --prefix "${WORK_DIR}/prefix")
  list(APPEND consumer_args "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
elseif(MODE STREQUAL "add_subdirectory")
  list(APPEND consumer_args "-DKVATTN_SOURCE_DIR=${KVATTN_SOURCE_DIR}")
else()
  message(FATAL_ERROR "MODE must be find_package or add_subdirectory, got '${MODE}'")
endif()
run("${CMAKE_COMMAND}" -S "${CMAKE_CURRENT_LIST_DIR}/${MODE}" -B "${WORK_DIR}/build" ${consumer_args})
run("${CMAKE_COMMAND}" --build "${WORK_DIR}/build")
run("${WORK_DIR}/build/consumer")
if(EXISTS "${WORK_DIR}/build/consumer_kernels")
  run("${WORK_DIR}/build/consumer_kernels")
elseif(MODE STREQUAL "find_package" AND KERNELS)
  message(FATAL_ERROR "kvattn was installed with its compiled kernels, but the consumer did not find kvattn::kernels")
endif()
