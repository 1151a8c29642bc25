# Helpers that register epmoe's tests; included by tests/CMakeLists.txt after include(Catch).
include_guard(GLOBAL)

set(_epmoe_testing_dir "${CMAKE_CURRENT_LIST_DIR}")

# True in <out> when every source exists; otherwise warns (a typo or a file not written yet).
function(_epmoe_sources_exist out what)
  foreach(src IN LISTS ARGN)
    if(NOT IS_ABSOLUTE "${src}")
      set(src "${CMAKE_CURRENT_SOURCE_DIR}/${src}")
    endif()
    if(NOT EXISTS "${src}")
      message(WARNING "epmoe: skipping ${what}: ${src} does not exist")
      set(${out} FALSE PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(${out} TRUE PARENT_SCOPE)
endfunction()

# epmoe_add_test(<name> <sources...> [UNITY] [LIBS <targets...>] [LABELS <labels...>] [TIMEOUT <s>])
# One Catch2 executable; Catch2WithMain supplies main(), each TEST_CASE becomes a CTest test
# named "<name>:<case>" (Catch passes the prefix through cmake -D, which drops a trailing
# space) labelled "unit" plus <labels>, plus count.<name> (see epmoe_discover_tests).
# TIMEOUT: seconds per test, 60 by default: the slowest case takes 0.2 s in Release on 2
# cores, so 60 s leaves room for Debug and sanitizer builds and only stops a deadlock.
function(epmoe_add_test name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "UNITY" "TIMEOUT" "LIBS;LABELS")
  _epmoe_sources_exist(ok "test ${name}" ${arg_UNPARSED_ARGUMENTS})
  if(NOT ok)
    return()
  endif()
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 60)
  endif()
  add_executable(${name} ${arg_UNPARSED_ARGUMENTS})
  # UNITY: the files compile as one unit and share the layer's instantiations instead of
  # compiling them once each (test_layer's six files: 63 -> 26 s CPU); each file then keeps
  # its helpers in a namespace of its own.
  if(arg_UNITY)
    set_target_properties(${name} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 0)
  endif()
  target_link_libraries(${name} PRIVATE epmoe::epmoe ${arg_LIBS} Catch2::Catch2WithMain)
  target_compile_options(${name} PRIVATE
    $<$<COMPILE_LANG_AND_ID:CXX,GNU,Clang,AppleClang>:-Wall -Wextra -Wpedantic>)
  epmoe_discover_tests(${name} TIMEOUT ${arg_TIMEOUT} LABELS unit ${arg_LABELS})
endfunction()

# epmoe_discover_tests(<target> TIMEOUT <s> [LABELS <labels...>] [PROPERTIES <name value>...])
# Registers each TEST_CASE of the Catch2 binary <target> as the CTest test "<target>:<case>",
# with these labels, TIMEOUT and properties, and so that no test can pass without running:
# - each runs with --warn NoTests, so a name that matches no test case exits 2, not 0;
# - count.<target> fails unless CTest holds as many "<target>:" tests as the binary lists
#   (a ';' in a name splits it in two, and discovery can drop one).
function(epmoe_discover_tests name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TIMEOUT" "LABELS;PROPERTIES")
  if(NOT arg_TIMEOUT)
    message(FATAL_ERROR "epmoe_discover_tests(${name}): TIMEOUT is required")
  endif()
  catch_discover_tests(${name} TEST_PREFIX "${name}:" TEST_LIST ${name}_TESTS
                       EXTRA_ARGS --warn NoTests PROPERTIES ${arg_PROPERTIES})
  # Catch's discovery script splits a PROPERTIES list, so labels are set after its tests load.
  set(labels_file "${CMAKE_CURRENT_BINARY_DIR}/${name}_labels.cmake")
  file(WRITE "${labels_file}" "if(${name}_TESTS)\n"
    "  set_tests_properties(\${${name}_TESTS} PROPERTIES LABELS \"${arg_LABELS}\"\n"
    "                       TIMEOUT ${arg_TIMEOUT})\n"
    "endif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${labels_file}")
  add_test(NAME count.${name}
    COMMAND "${CMAKE_COMMAND}" "-DEXE=$<TARGET_FILE:${name}>" "-DPREFIX=${name}:"
            "-DCTEST=${CMAKE_CTEST_COMMAND}" "-DBUILD_DIR=${PROJECT_BINARY_DIR}"
            -P "${_epmoe_testing_dir}/check_test_count.cmake")
  set_tests_properties(count.${name} PROPERTIES LABELS "unit;count" TIMEOUT 60)
endfunction()

# epmoe_add_timeouts_check()
# The test tests.timeouts: fails if any test of this build tree has no TIMEOUT, so that a
# test added later cannot hang CI. Call once, from the top test directory.
function(epmoe_add_timeouts_check)
  add_test(NAME tests.timeouts
    COMMAND "${CMAKE_COMMAND}" "-DCTEST=${CMAKE_CTEST_COMMAND}"
            "-DBUILD_DIR=${PROJECT_BINARY_DIR}"
            -P "${_epmoe_testing_dir}/check_test_timeouts.cmake")
  set_tests_properties(tests.timeouts PROPERTIES LABELS "unit;count" TIMEOUT 60)
endfunction()

# epmoe_add_compile_fail_test(<name> <source> <regex>)
# <source> must NOT compile, and the compiler output must match <regex> (the static_assert
# message), so a typo or a missing include cannot pass for the check firing.
function(epmoe_add_compile_fail_test name source regex)
  _epmoe_sources_exist(ok "compile-fail test ${name}" ${source})
  if(NOT ok)
    return()
  endif()
  add_executable(${name} EXCLUDE_FROM_ALL ${source})
  set_target_properties(${name} PROPERTIES EXCLUDE_FROM_DEFAULT_BUILD ON)
  target_link_libraries(${name} PRIVATE epmoe::epmoe)
  add_test(NAME compile_fail.${name}
    COMMAND "${CMAKE_COMMAND}" "-DBUILD_DIR=${CMAKE_BINARY_DIR}" "-DTARGET=${name}"
            "-DCONFIG=$<CONFIG>" "-DREGEX=${regex}"
            -P "${_epmoe_testing_dir}/run_compile_fail.cmake")
  # Builds in one tree must not run concurrently (make would race on shared files).
  set_tests_properties(compile_fail.${name} PROPERTIES
    LABELS compile_fail RESOURCE_LOCK epmoe_build_tree TIMEOUT 300)
endfunction()

# epmoe_add_mpi_test(<name> <exe> <ranks>)
# Runs <exe> on <ranks> MPI processes through mpiexec, labelled "mpi". Open MPI refuses root
# without --allow-run-as-root and more ranks than cores without --oversubscribe (these 2-core
# machines); other MPIs do not know these flags, so they are added for Open MPI only.
function(epmoe_add_mpi_test name exe ranks)
  epmoe_mpiexec_flags(flags ${ranks})
  add_test(NAME ${name}
    COMMAND "${MPIEXEC_EXECUTABLE}" ${flags} ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${exe}>
            ${MPIEXEC_POSTFLAGS})
  set_tests_properties(${name} PROPERTIES LABELS mpi TIMEOUT 60 PROCESSORS ${ranks})
endfunction()

# epmoe_add_mpi_fault_test(<name> <exe> <ranks> <scenario> <exchange_timeout>)
# tests/mpi/faults.sh: <exe> on <ranks> processes, the last one failing with <scenario>
# (throws, stalls, exits); the script checks every rank's line. A CTest TIMEOUT: a hang fails.
function(epmoe_add_mpi_fault_test name exe ranks scenario timeout)
  epmoe_mpiexec_flags(flags ${ranks})
  add_test(NAME ${name}
    COMMAND bash "${PROJECT_SOURCE_DIR}/tests/mpi/faults.sh" ${scenario} ${ranks} ${timeout}
            "${MPIEXEC_EXECUTABLE}" ${flags} ${MPIEXEC_PREFLAGS} -- $<TARGET_FILE:${exe}>)
  set_tests_properties(${name} PROPERTIES LABELS "mpi;faults" TIMEOUT 60 PROCESSORS ${ranks})
endfunction()

# epmoe_mpiexec_flags(<out var> <ranks>): mpiexec's flags for <ranks> processes here.
function(epmoe_mpiexec_flags out ranks)
  if(NOT DEFINED CACHE{EPMOE_MPIEXEC_IS_OPENMPI})
    execute_process(COMMAND "${MPIEXEC_EXECUTABLE}" --version
                    OUTPUT_VARIABLE _out ERROR_QUIET RESULT_VARIABLE _rc)
    set(_is OFF)
    if(_rc EQUAL 0 AND _out MATCHES "Open MPI|OpenRTE")
      set(_is ON)
    endif()
    set(EPMOE_MPIEXEC_IS_OPENMPI ${_is} CACHE INTERNAL "mpiexec is Open MPI's")
  endif()
  set(flags ${MPIEXEC_NUMPROC_FLAG} ${ranks})
  if(EPMOE_MPIEXEC_IS_OPENMPI)
    execute_process(COMMAND id -u OUTPUT_VARIABLE _uid OUTPUT_STRIP_TRAILING_WHITESPACE
                    ERROR_QUIET)
    if(_uid STREQUAL "0")
      list(APPEND flags --allow-run-as-root)
    endif()
    if(ranks GREATER 2)
      list(APPEND flags --oversubscribe)
    endif()
  endif()
  set(${out} ${flags} PARENT_SCOPE)
endfunction()

# epmoe_add_cli_tests(<label> <programs...>)
# help.<program> and badflag.<program> for each program that is a target: --help prints the
# usage on stdout and exits 0; an unknown flag prints it on stderr and exits 2, the program not
# started (examples/args.hpp; the rule in check_cli.cmake).
function(epmoe_add_cli_tests label)
  foreach(program IN LISTS ARGN)
    if(NOT TARGET ${program})
      continue()
    endif()
    foreach(mode IN ITEMS help badflag)
      add_test(NAME ${mode}.${program}
               COMMAND "${CMAKE_COMMAND}" "-DPROGRAM=$<TARGET_FILE:${program}>"
                       "-DNAME=${program}" "-DMODE=${mode}"
                       -P "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/check_cli.cmake")
      set_tests_properties(${mode}.${program} PROPERTIES LABELS "${label};cli" TIMEOUT 30)
    endforeach()
  endforeach()
endfunction()
