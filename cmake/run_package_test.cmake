# Builds and runs a consumer project the way a user would.
#   cmake -DMODE=install|subdir -DSOURCE_DIR=<consumer> -DWORK_DIR=<scratch> -DEPMOE_BUILD=<build>
#         -DEPMOE_SOURCE=<repo> [-DCONFIG=<cfg>] [-DGENERATOR=<gen>] [-DCXX=<compiler>]
#         [-DEXPECT_CBLAS=ON|OFF] [-DEXPECT_TARGETS=a,b] -P run_package_test.cmake
# install: installs EPMOE_BUILD to WORK_DIR/prefix and uses find_package(epmoe).
# subdir:  the consumer calls add_subdirectory(EPMOE_SOURCE).
foreach(var MODE SOURCE_DIR WORK_DIR EPMOE_BUILD EPMOE_SOURCE)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_package_test.cmake: -D${var}=... is required")
  endif()
endforeach()

function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}")
  endif()
  message(STATUS "${what}: ok")
endfunction()

set(config_args "")
set(build_type Release)
if(CONFIG)
  set(config_args --config "${CONFIG}")
  set(build_type "${CONFIG}")
endif()
string(REPLACE "," ";" EXPECT_TARGETS "${EXPECT_TARGETS}")

# A fresh scratch folder each run, so nothing of a previous install can be found.
file(REMOVE_RECURSE "${WORK_DIR}")
set(configure_args -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" "-DCMAKE_BUILD_TYPE=${build_type}"
    "-DEXPECT_CBLAS=${EXPECT_CBLAS}" "-DEXPECT_TARGETS=${EXPECT_TARGETS}")
if(GENERATOR)
  list(APPEND configure_args -G "${GENERATOR}")
endif()
if(CXX)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX}")
endif()

if(MODE STREQUAL "install")
  step("install to ${WORK_DIR}/prefix"
       "${CMAKE_COMMAND}" --install "${EPMOE_BUILD}" --prefix "${WORK_DIR}/prefix" ${config_args})
  list(APPEND configure_args "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
elseif(MODE STREQUAL "subdir")
  # Same BLAS choice as the build under test, so the expectation below holds.
  list(APPEND configure_args "-DEPMOE_SOURCE_DIR=${EPMOE_SOURCE}" "-DEPMOE_WITH_BLAS=${EXPECT_CBLAS}")
else()
  message(FATAL_ERROR "run_package_test.cmake: MODE must be install or subdir, not '${MODE}'")
endif()

step("configure consumer" "${CMAKE_COMMAND}" ${configure_args})
step("build consumer" "${CMAKE_COMMAND}" --build "${WORK_DIR}/build" ${config_args})
# Multi-config generators put the program in a per-config folder.
find_program(consumer NAMES epmoe_consumer PATHS "${WORK_DIR}/build" "${WORK_DIR}/build/${CONFIG}"
             NO_DEFAULT_PATH REQUIRED)
step("run consumer" "${consumer}")
