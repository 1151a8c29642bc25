# What the build under test promised (passed by cmake/run_package_test.cmake): the optional
# targets it made and whether epmoe::epmoe carries CBLAS. main.cpp checks the latter.
set(EXPECT_CBLAS OFF CACHE BOOL "epmoe::epmoe should define EPMOE_HAS_CBLAS")
set(EXPECT_TARGETS "" CACHE STRING "Targets epmoe should provide, e.g. epmoe::cuda")
foreach(t IN LISTS EXPECT_TARGETS)
  if(NOT TARGET ${t})
    message(FATAL_ERROR "epmoe did not provide ${t}")
  endif()
endforeach()

function(epmoe_consumer_expect target)
  target_compile_definitions(${target} PRIVATE EXPECT_CBLAS=$<BOOL:${EXPECT_CBLAS}>)
endfunction()
