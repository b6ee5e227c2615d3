#[::idem_runtime::__private::grpc::async_trait]
impl refunds_server::Refunds for RefundsApi {
    async fn refund(
        &self,
        __idem_grpc: Request<Refund>,
    ) -> Result<Response<Refund>, Status> {
        #[allow(unused_imports)]
        use idempotent as _;
        static __IDEM_POLICY: ::idem_runtime::__private::HandlerPolicy = ::idem_runtime::__private::HandlerPolicy::__new(
                "refund",
                ::core::module_path!(),
                ::idem_runtime::__private::KeyScope::Global,
                ::idem_runtime::__private::Mode::External,
                86400u64,
                false,
                10u64,
                ::core::option::Option::Some(5u64),
                ::core::option::Option::None,
                ::idem_runtime::__private::BodyFields::All,
            )
            .__grpc(
                <refunds_server::RefundsServer<
                    (),
                > as ::idem_runtime::__private::grpc::tonic::server::NamedService>::NAME,
                "Refund",
            );
        ::idem_runtime::__private::inventory::submit! {
            ::idem_runtime::__private::Registered(& __IDEM_POLICY)
        }
        let (request, __idem_request) = match ::idem_runtime::__private::grpc::accept::<
            Sqlite,
            Self,
            _,
        >(self, &__IDEM_POLICY, __idem_grpc) {
            ::core::result::Result::Ok(__idem_accepted) => __idem_accepted,
            ::core::result::Result::Err(__idem_status) => {
                return ::core::result::Result::Err(__idem_status);
            }
        };
        let __idem_span = __idem_request.span();
        ::idem_runtime::__private::Instrument::instrument(
                async move {
                    let __idem_scope = ::idem_runtime::__private::StoredScope::Global;
                    let __idem_options = __IDEM_POLICY.__options();
                    #[allow(unused_mut)]
                    let mut __idem_claim = match ::idem_runtime::__private::ExternalClaim::<
                        Sqlite,
                    >::acquire(__idem_request, __idem_scope, __idem_options)
                        .await
                    {
                        ::core::result::Result::Ok(__idem_claim) => __idem_claim,
                        ::core::result::Result::Err(__idem_answer) => {
                            return ::idem_runtime::__private::grpc::answer(__idem_answer)
                                .await;
                        }
                    };
                    let __idem_into_response = |
                        __idem_output: Result<Response<Refund>, Status>,
                    | -> ::idem_runtime::__private::Response {
                        ::idem_runtime::__private::grpc::into_http(__idem_output)
                    };
                    let __idem_limit = __idem_claim.limit();
                    let __idem_output = {
                        let ctx: IdempotencyContext = __idem_claim.context();
                        ::idem_runtime::__private::run_until(
                                __idem_limit,
                                ::idem_runtime::__private::typed_body::<
                                    Result<Response<Refund>, Status>,
                                    _,
                                >(async move {
                                    call_processor(
                                            ctx.derive("processor"),
                                            request.into_inner(),
                                        )
                                        .await
                                }),
                            )
                            .await
                    };
                    let __idem_response = match __idem_output {
                        ::core::option::Option::Some(__idem_value) => {
                            __idem_into_response(__idem_value)
                        }
                        ::core::option::Option::None => {
                            return ::idem_runtime::__private::grpc::answer(
                                    __idem_claim.stopped(__idem_limit).await,
                                )
                                .await;
                        }
                    };
                    ::idem_runtime::__private::grpc::answer(
                            __idem_claim.complete(__idem_response).await,
                        )
                        .await
                },
                __idem_span,
            )
            .await
    }
}
