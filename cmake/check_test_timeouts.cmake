# cmake -DCTEST=<ctest> -DBUILD_DIR=<tree> -P check_test_timeouts.cmake
# Fails if any CTest test in the tree has no TIMEOUT property: without one a deadlocked test
# hangs CI with no limit.
foreach(var IN ITEMS CTEST BUILD_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_test_timeouts: -D${var}=... is required")
  endif()
endforeach()

execute_process(COMMAND "${CTEST}" --show-only=json-v1
                WORKING_DIRECTORY "${BUILD_DIR}" OUTPUT_VARIABLE json ERROR_VARIABLE err
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "check_test_timeouts: ctest --show-only=json-v1 failed (${rc}):\n${err}")
endif()

string(JSON count LENGTH "${json}" tests)
if(count EQUAL 0)
  message(FATAL_ERROR "check_test_timeouts: no tests in ${BUILD_DIR}")
endif()
set(missing "")
set(checked 0)
math(EXPR last "${count} - 1")
foreach(i RANGE ${last})
  string(JSON test GET "${json}" tests ${i})  # parse the small object, not the whole list again
  string(JSON name GET "${test}" name)
  # Catch's placeholder for an unbuilt binary: CTest reports it as not run, never as passed.
  if(name MATCHES "_NOT_BUILT")
    continue()
  endif()
  math(EXPR checked "${checked} + 1")
  set(timeout "")
  string(JSON nprops ERROR_VARIABLE no_props LENGTH "${test}" properties)
  if(NOT no_props AND nprops GREATER 0)
    math(EXPR plast "${nprops} - 1")
    foreach(j RANGE ${plast})
      string(JSON prop GET "${test}" properties ${j} name)
      if(prop STREQUAL "TIMEOUT")
        string(JSON timeout GET "${test}" properties ${j} value)
      endif()
    endforeach()
  endif()
  if(NOT timeout MATCHES "^[0-9.]+$" OR timeout EQUAL 0)
    string(APPEND missing "\n  ${name}")
  endif()
endforeach()

if(missing)
  message(FATAL_ERROR "check_test_timeouts: these tests have no TIMEOUT (give each one; "
                      "cmake/EpmoeTesting.cmake does for Catch tests):${missing}")
endif()
message(STATUS "check_test_timeouts: all ${checked} tests have a TIMEOUT")
