# cmake -DBUILD_DIR=<dir> -DTARGET=<target> -DREGEX=<regex> [-DCONFIG=<cfg>] -P run_compile_fail.cmake
# Succeeds only when building <target> fails and the output matches <regex>.
foreach(var BUILD_DIR TARGET REGEX)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_compile_fail.cmake: -D${var}=... is required")
  endif()
endforeach()
set(config_args "")
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()

execute_process(
  COMMAND "${CMAKE_COMMAND}" --build "${BUILD_DIR}" --target "${TARGET}" ${config_args}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)

if(rc EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled, but it must not:\n${out}")
endif()
if(NOT out MATCHES "${REGEX}")
  message(FATAL_ERROR "${TARGET} failed to build, but its output does not match "
                      "'${REGEX}' (a different error?):\n${out}")
endif()
message(STATUS "${TARGET} failed to compile as expected (matched '${REGEX}')")
