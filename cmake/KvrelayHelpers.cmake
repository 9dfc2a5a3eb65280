# Shared compile settings and the helpers every component uses.
add_library(kvrelay_warnings INTERFACE)
# GCC 12 reports false -Wrestrict/-Wstringop-overflow on std::string at -O2 (GCC bug 105329).
# Host-compiler flags apply to C/C++ sources; CUDA sources get nvcc's own
# warning flags and the host flags through -Xcompiler.
target_compile_options(kvrelay_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:C,CXX>:-Wall -Wextra -Wno-unused-parameter>
  $<$<AND:$<COMPILE_LANGUAGE:C,CXX>,$<CXX_COMPILER_ID:GNU>>:-Wno-restrict -Wno-stringop-overflow>
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter>)
if(KVRELAY_WERROR)
  target_compile_options(kvrelay_warnings INTERFACE $<$<COMPILE_LANGUAGE:C,CXX>:-Werror>
    $<$<COMPILE_LANGUAGE:CUDA>:--Werror=all-warnings -Xcompiler=-Werror>)
endif()
if(KVRELAY_SANITIZE)
  # GCC 12's -Wmaybe-uninitialized misfires under -fsanitize=address on
  # Boost.Beast's parser (boost::optional in content_length(), seen in the HTTP
  # fuzz target); the warning stays on, with -Werror, in every other build.
  target_compile_options(kvrelay_warnings INTERFACE -fsanitize=address,undefined -fno-omit-frame-pointer
    $<$<CXX_COMPILER_ID:GNU>:-Wno-maybe-uninitialized>)
  target_link_options(kvrelay_warnings INTERFACE -fsanitize=address,undefined)
endif()
if(KVRELAY_TSAN)
  # GCC's -Wtsan flags Boost.Asio's std::atomic_thread_fence (TSan cannot model
  # fences); it is a warning about the tool, not the code, so -Werror must not stop on it.
  # -Wmaybe-uninitialized misfires under the instrumentation as under ASan
  # (above): on the AVX2 kernels' per-row scale arrays, filled by a loop of
  # compile-time length; it stays on, with -Werror, in the release build.
  target_compile_options(kvrelay_warnings INTERFACE -fsanitize=thread -fno-omit-frame-pointer
    $<$<CXX_COMPILER_ID:GNU>:-Wno-tsan -Wno-maybe-uninitialized>)
  target_link_options(kvrelay_warnings INTERFACE -fsanitize=thread)
endif()
# Sanitizer reports fail the test (a UBSan report alone would only print).
set(KVRELAY_SANITIZER_ENV
  "ASAN_OPTIONS=abort_on_error=1:detect_leaks=1"
  "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1"
  "TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1")

# kvrelay_add_library(<name> SOURCES ... [DEPS ...] [PRIVATE_DEPS ...])
# One static library per component; include root is the repository root so
# headers are included as "engine/gguf.h".
function(kvrelay_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE kvrelay_warnings ${ARG_PRIVATE_DEPS})
  target_compile_definitions(${name} PUBLIC
    KVRELAY_WITH_CUDA=$<BOOL:${KVRELAY_WITH_CUDA}>
    KVRELAY_WITH_NCCL=$<BOOL:${KVRELAY_WITH_NCCL}>)
endfunction()

# kvrelay_add_executable(<name> SOURCES ... [DEPS ...])
function(kvrelay_add_executable name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE kvrelay_warnings ${ARG_DEPS})
endfunction()

# kvrelay_add_test(<name> SOURCES ... [DEPS ...] [LABELS ...] [TIMEOUT s])
# A GoogleTest binary registered with CTest as one test per binary, labelled.
function(kvrelay_add_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  # kvrelay_gtest_main (tests/testing/gtest_main.cc) in place of gtest_main:
  # a binary whose every test skipped exits 77, which ctest reports as a skip.
  target_link_libraries(${name} PRIVATE kvrelay_warnings ${ARG_DEPS} GTest::gtest kvrelay_gtest_main)
  add_test(NAME ${name} COMMAND ${name})
  if(NOT ARG_LABELS)
    set(ARG_LABELS unit)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT}
    SKIP_RETURN_CODE 77
    ENVIRONMENT "KVRELAY_SOURCE_DIR=${PROJECT_SOURCE_DIR};KVRELAY_BINARY_DIR=${PROJECT_BINARY_DIR};${KVRELAY_SANITIZER_ENV}")
endfunction()
