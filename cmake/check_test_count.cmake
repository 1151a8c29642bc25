# cmake -DEXE=<test binary> -DPREFIX=<ctest name prefix> -DCTEST=<ctest> -DBUILD_DIR=<tree>
#       -P check_test_count.cmake
# Fails unless CTest registered exactly as many tests named "<PREFIX>..." as the Catch binary
# lists: a test name that discovery splits (a ';' in it) or drops would otherwise pass unseen.
foreach(var IN ITEMS EXE PREFIX CTEST BUILD_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_test_count: -D${var}=... is required")
  endif()
endforeach()

execute_process(COMMAND "${EXE}" --list-test-names-only
                OUTPUT_VARIABLE names ERROR_VARIABLE err RESULT_VARIABLE rc)
# Catch v2 exits with the number of tests it lists; a crash is a string or a signal.
if(NOT rc MATCHES "^[0-9]+$")
  message(FATAL_ERROR "check_test_count: ${EXE} --list-test-names-only failed: ${rc}\n${err}")
endif()
# Count lines without making a CMake list of the names (a ';' in a name would split it).
string(REGEX REPLACE "\n+" "\n" names "\n${names}\n")
string(REGEX REPLACE "[^\n]" "" newlines "${names}")
string(LENGTH "${newlines}" listed)
math(EXPR listed "${listed} - 1")

# Tests named "<PREFIX>..." in this build tree, as CTest sees them (no test is run).
string(REGEX REPLACE "([][.*+?^$()|\\])" "\\\\\\1" prefix_regex "${PREFIX}")
execute_process(COMMAND "${CTEST}" -N -R "^${prefix_regex}"
                WORKING_DIRECTORY "${BUILD_DIR}" OUTPUT_VARIABLE out RESULT_VARIABLE ctest_rc)
if(NOT ctest_rc EQUAL 0 OR NOT out MATCHES "Total Tests: ([0-9]+)")
  message(FATAL_ERROR "check_test_count: ctest -N failed (${ctest_rc}):\n${out}")
endif()
set(registered "${CMAKE_MATCH_1}")

if(NOT listed EQUAL registered)
  message(FATAL_ERROR
    "check_test_count: ${EXE} lists ${listed} tests but CTest registered ${registered} named "
    "'${PREFIX}...': a name with ';' is split by catch_discover_tests, or discovery dropped "
    "one (rebuild, and rename any test with ';').\nCTest:\n${out}")
endif()
message(STATUS "check_test_count: ${listed} tests listed, ${registered} registered")
