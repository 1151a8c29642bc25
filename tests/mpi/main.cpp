// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Catch2's main for the MPI tests: every rank runs every test case under mpiexec, so test
// cases must stay collective (CHECK, never REQUIRE, around a collective call).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <epmoe/comm/mpi.hpp>

int main(int argc, char** argv) {
  epmoe::comm::mpi_session session(argc, argv);
  return Catch::Session().run(argc, argv);
}
